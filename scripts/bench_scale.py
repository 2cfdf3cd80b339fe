"""The GDN CP modes at growing rank counts: measured here beside the cost model, and predicted far.

Two parts, one JSON (and a PNG of where each mode wins), from :mod:`benchkit.scale`:

- measured: one GDN layer, forward+backward, on forked gloo ranks at each ``--cps`` (default 2, 4,
  8), every mode the rank count allows (the two-level ones with ``--inner-size`` ranks per inner
  group): the worst rank's bytes sent (the platform's ``bytes_sent``, less the 8-byte length
  exchange; at cp 2 no rank sends both ways, so it is below the model's worst rank), its
  message-sending calls, the median forward+backward time, and what the mode adds to the same
  layer without CP on the rank's T/cp tokens (timed in the same run); beside them
  ``plan_context_parallel``'s bytes, messages in sequence and added seconds for the ``cpu``
  machine calibrated by this run (gloo's latency and bandwidth by ping-pong, the chunk rule's
  FLOP rate by timing it);
- predicted: ``plan_context_parallel`` for Qwen3.5-27B's and Qwen3.5-397B-A17B's GDN heads at cp
  8..256 and T 128K..1M on the ``gpu`` and ``npu`` machines (nodes of 8; two-level modes with a
  node as the inner group);
- splits: the whole models (Qwen3.5-27B, and the MoE 397B-A17B, 122B-A10B and 35B-A3B) split
  over 8..256 devices as ep x tp x cp (tensor parallelism inside a node, expert parallelism over
  the CP ranks), ranked by ``rank_tp_cp_splits`` at 128K, 256K and 1M tokens with the mode
  ``auto`` picks and the memory per rank (:mod:`benchkit.splits`), the fewest devices whose best
  split fits the budget per model and T, and ``splits.png``: the best tp per point.

The predictions alone (no ranks, seconds): ``--predict-only``. Timing claims need a quiet
machine; on a shared one run it small, to see that it works::

    PYTHONPATH=. python scripts/bench_scale.py --seq-len 256 --cps 2 4 --repeats 1 --out /tmp/scale
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchkit.machine import load_average, machine_info
from benchkit.output import Panel, save_png, write_json
from benchkit.ranks import on_ranks
from benchkit.scale import GEOMETRIES, ONE_LEVEL, TWO_LEVEL, measure_modes, measured_rows, predicted_rows
from benchkit.splits import MODELS, split_rows
from hyperpar_gdn.cli import HelpFormatter


def where_each_mode_wins(rows: list[dict]) -> list[Panel]:
    """One panel per (model, device): a square per (cp, T) in the colour of the model's choice."""
    panels = []
    for model in GEOMETRIES:
        for device in ("gpu", "npu"):
            points: dict[str, list[tuple[float, float]]] = {m: [] for m in ONE_LEVEL + TWO_LEVEL}
            for r in rows:
                if (r["model"], r["device"]) == (model, device):
                    points[r["choice"]].append((r["cp"], r["seq_len"] / 1024))
            title = f"{model}, {device}: fastest mode"
            panels.append(Panel(title, "cp", "T (K tokens)", points=points, log2_x=True, log2_y=True))
    return panels


def print_predictions(rows: list[dict]) -> None:
    """The issue's grid: per model, device, T (128K, 256K, 1M) and cp (8..64), the mode auto picks,
    the predicted step per GDN layer and the CP state memory per rank."""
    print(f"{'model':<18} {'device':<6} {'T':>6} {'cp':>3} {'auto':<14} {'ms/layer':>9} {'state MiB':>9}")
    for r in rows:
        if r["seq_len"] in (131072, 262144, 1048576) and r["cp"] <= 64:
            print(
                f"{r['model']:<18} {r['device']:<6} {r['seq_len'] // 1024:>5}K {r['cp']:>3} {r['choice']:<14} "
                f"{r['layer_seconds'] * 1e3:>9.2f} {r['state_mib']:>9.1f}"
            )


def best_split_map(rows: list[dict]) -> list[Panel]:
    """One panel per (model, device): a square per (devices, T) in the colour of the best split's
    tp, or of "none fits" where no split fits the memory budget."""
    panels = []
    for model in MODELS:
        for device in ("gpu", "npu"):
            points: dict[str, list[tuple[float, float]]] = {f"tp {t}": [] for t in (1, 2, 4, 8, 16)}
            points["none fits"] = []
            for r in rows:
                if (r["model"], r["device"]) == (model, device):
                    label = f"tp {r['best']['tp']}" if r["best_fits"] else "none fits"
                    points[label].append((r["devices"], r["seq_len"] / 1024))
            title = f"{model}, {device}: fastest tp x cp that fits"
            panels.append(Panel(title, "devices", "T (K tokens)", points=points, log2_x=True, log2_y=True))
    return panels


def _name(s: dict) -> str:
    """ep x tp x cp of a split."""
    return f"{s['ep']}x{s['tp']}x{s['cp']}"


def print_splits(rows: list[dict]) -> None:
    """Per model, device, T and devices: the ranking's first five (ep x tp x cp: ms per GDN layer,
    GiB per rank; * over the budget), and the best split with the mode auto picks; then per model,
    device and T the fewest devices whose best split fits the budget."""
    print(
        f"{'model':<18} {'dev':<4} {'T':>6} {'D':>3} {'best':<9} {'auto':<13} first five (ms/layer, GiB/rank)"
    )
    for r in rows:
        ranked = [
            f"{_name(s)} {s['layer_seconds'] * 1e3:.1f}ms {s['memory_gib']:.0f}G{'' if s['fits'] else '*'}"
            for s in r["ranking"]
            if s["feasible"]
        ]
        best = r["best"]
        mode = best["mode"] or "none"
        print(
            f"{r['model']:<18} {r['device']:<4} {r['seq_len'] // 1024:>5}K {r['devices']:>3} "
            f"{_name(best):<9} {mode:<13} " + "; ".join(ranked[:5])
        )
    print(f"{'model':<18} {'dev':<4} {'T':>6} fewest devices whose best split fits (ep x tp x cp)")
    for model, device, t in dict.fromkeys((r["model"], r["device"], r["seq_len"]) for r in rows):
        fits = [
            r
            for r in rows
            if (r["model"], r["device"], r["seq_len"]) == (model, device, t) and r["best_fits"]
        ]
        line = "none up to the largest count"
        if fits:
            r = min(fits, key=lambda r: r["devices"])
            s = r["ranking"][0]
            line = (
                f"{r['devices']} devices: {_name(s)} {s['mode'] or 'none'} {s['layer_seconds'] * 1e3:.1f} ms/layer "
                f"(ep {s['ep_seconds'] * 1e3:.1f}), {s['memory_gib']:.1f} GiB of {r['budget_gib']:.0f}"
            )
        print(f"{model:<18} {device:<4} {t // 1024:>5}K {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the measured layer")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8], help="rank counts measured")
    parser.add_argument("--inner-size", type=int, default=2, help="inner group of the two-level modes")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward+backward per mode")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the measured layer")
    parser.add_argument(
        "--heads",
        type=int,
        nargs=4,
        default=[2, 8, 64, 64],
        metavar=("HK", "HV", "DK", "DV"),
        help="key heads, value heads, key and value head dims",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="seconds per measurement")
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="skip the measured part: the predictions' JSON and PNG only",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench_scale"), help="folder for scale.json and scale.png"
    )
    args = parser.parse_args()
    if args.seq_len % max(args.cps) or min(args.cps) < 2 or args.repeats < 1 or args.inner_size < 1:
        parser.error(
            f"--seq-len {args.seq_len} must divide by every --cps {args.cps} (each >= 2); "
            f"--repeats {args.repeats} and --inner-size {args.inner_size} >= 1"
        )
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    job = {
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "hidden": args.hidden,
        "inner_size": args.inner_size,
        "heads": dict(zip(names, args.heads, strict=True)),
    }
    result = {"machine": machine_info(), "job": job, "measured": [], "predicted": predicted_rows()}
    result["splits"] = split_rows()
    json_path = args.out / "scale.json"
    save_png(args.out / "splits.png", best_split_map(result["splits"]))
    if args.predict_only:
        write_json(json_path, result)
        save_png(args.out / "scale.png", where_each_mode_wins(result["predicted"]))
        print_predictions(result["predicted"])
        print_splits(result["splits"])
        print(f"wrote {json_path}, scale.png and splits.png")
        return
    for cp in args.cps:
        per_rank = on_ranks(measure_modes, cp, job, timeout_s=args.timeout_s)
        result["measured"] += measured_rows(cp, job, per_rank)
        write_json(json_path, result)  # after every finished part
    save_png(args.out / "scale.png", where_each_mode_wins(result["predicted"]))
    machine = result["measured"][0]["machine"]
    print(
        f"cpu machine measured: {machine['bandwidth'] / 1e9:.2f} GB/s, {machine['latency'] * 1e6:.0f} us "
        f"per message, chunk rule {machine['flops'] / 1e9:.1f} GFLOP/s"
    )
    print(
        f"{'cp':>3} {'mode':<19} {'bytes':>10} {'pred':>10} {'calls':>5} {'pred':>5} {'ms':>8} "
        f"{'local ms':>8} {'added':>7} {'pred added':>10}"
    )
    for r in result["measured"]:
        print(
            f"{r['cp']:>3} {r['mode']:<19} {r['bytes']:>10} {r['predicted_bytes']:>10.0f} {r['calls']:>5} "
            f"{r['predicted_messages']:>5.0f} {r['seconds'] * 1e3:>8.1f} {r['local_seconds'] * 1e3:>8.1f} "
            f"{r['added_seconds'] * 1e3:>7.1f} {r['predicted_seconds'] * 1e3:>10.1f}"
        )
    print_predictions(result["predicted"])
    print_splits(result["splits"])
    print(
        f"load average {load_average()[0]:.1f} (timings need a quiet machine); "
        f"wrote {json_path}, scale.png and splits.png"
    )


if __name__ == "__main__":
    main()
