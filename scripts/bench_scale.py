"""The GDN CP modes at growing rank counts: measured here beside the cost model, and predicted far.

Two parts, one JSON (and a PNG of where each mode wins):

- measured: one GDN layer, forward+backward, on forked gloo ranks at each ``--cps`` (default 2, 4,
  8): per mode, the worst rank's bytes sent (the platform's ``bytes_sent``, less the 8-byte
  length exchange; at cp 2 no rank sends both ways, so it is below the model's worst rank), its
  communication calls (send, all_to_all, all_gather, shift_right; a collective is one call and
  its backward runs inside it, uncounted: for p2p and scan the sends are the rounds), the median time of the whole forward+backward, and beside them
  ``plan_context_parallel``'s bytes, messages in sequence and seconds for the ``cpu`` link (the
  model leaves out the work every mode shares, so its seconds are the modes' differences only);
- predicted: ``plan_context_parallel`` for Qwen3.5-27B's GDN heads (16 q/k and 48 value heads of
  128) at cp 8..256 and T 128K..1M on the ``gpu`` and ``npu`` links.

Timing claims need a quiet machine; on a shared one run it small, to see that it works::

    PYTHONPATH=. python scripts/bench_scale.py --seq-len 256 --cps 2 4 --repeats 1 --out /tmp/scale
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from hyperpar_gdn.cli import HelpFormatter

MODES = ("ulysses", "p2p", "all_gather", "scan")
COUNTED = ("send", "all_to_all", "all_gather", "shift_right")
QWEN35_27B = {"num_k_heads": 16, "num_v_heads": 48, "head_k_dim": 128, "head_v_dim": 128}
FAR_CPS = (8, 16, 32, 64, 128, 256)
FAR_TOKENS = (131072, 262144, 524288, 1048576)


def _measure(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """This rank's bytes, messages and times per mode (forward+backward of one layer)."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    comm = mesh.platform.collectives
    calls = {"n": 0}
    for name in COUNTED:  # count every message-sending call on this rank (instance attributes)
        original = getattr(comm, name)
        setattr(
            comm, name, lambda *a, _f=original, **k: (calls.__setitem__("n", calls["n"] + 1), _f(*a, **k))[1]
        )
    heads = job["heads"]
    out = {}
    for mode in MODES:
        if mode == "ulysses" and heads["num_v_heads"] % cp:
            continue
        torch.manual_seed(0)
        layer = GatedDeltaNet(
            job["hidden"],
            heads["num_k_heads"],
            heads["num_v_heads"],
            heads["head_k_dim"],
            heads["head_v_dim"],
        )
        LinearAttentionContextParallel(mode).apply(layer, mesh)
        x = torch.randn(1, job["seq_len"] // cp, job["hidden"], requires_grad=True)
        times, sent, messages = [], 0, 0
        for i in range(job["repeats"] + 1):  # the first is a warm-up
            comm.reset_bytes()
            calls["n"] = 0
            comm.barrier(mesh.get_group())
            t0 = time.perf_counter()
            layer(x).sum().backward()
            if i:
                times.append(time.perf_counter() - t0)
            sent, messages = comm.reset_bytes() - 8 * (cp - 1), calls["n"]
        out[mode] = {"bytes": sent, "calls": messages, "seconds": statistics.median(times)}
    return out


def _rank_main(rank: int, cp: int, port: int, job: dict[str, Any], queue: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1", HP_PLATFORM="cpu",
    )  # fmt: skip
    try:
        import torch

        torch.set_num_threads(1)
        queue.put((rank, "ok", _measure(rank, cp, job)))
    except BaseException:  # report to the parent instead of leaving it waiting
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(cp: int, job: dict[str, Any], *, timeout_s: float) -> list[dict[str, Any]]:
    """Fork ``cp`` ranks; their results in rank order (a failing rank raises with its traceback)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, cp, port, job, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < cp:
            rank, status, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(cp)]


def measured_rows(job: dict[str, Any], cps: list[int], timeout_s: float) -> list[dict[str, Any]]:
    """Per cp and mode: the worst rank's measurement beside the cost model's prediction."""
    from hyperpar_gdn import plan_context_parallel

    rows = []
    for cp in cps:
        per_rank = run_ranks(cp, job, timeout_s=timeout_s)
        plan = plan_context_parallel(
            seq_len=job["seq_len"], cp=cp, dtype="float32", device="cpu", **job["heads"]
        )
        predicted = {c.mode: c for c in plan.ranking}
        for mode in per_rank[0]:
            rows.append(
                {
                    "cp": cp,
                    "mode": mode,
                    "bytes": max(r[mode]["bytes"] for r in per_rank),
                    "calls": max(r[mode]["calls"] for r in per_rank),
                    "seconds": max(r[mode]["seconds"] for r in per_rank),
                    "predicted_bytes": predicted[mode].bytes_sent,
                    "predicted_messages": predicted[mode].messages,
                    "predicted_seconds": predicted[mode].seconds,
                }
            )
    return rows


def predicted_rows() -> list[dict[str, Any]]:
    from hyperpar_gdn import plan_context_parallel

    rows = []
    for device in ("gpu", "npu"):
        for t in FAR_TOKENS:
            for cp in FAR_CPS:
                plan = plan_context_parallel(seq_len=t, cp=cp, dtype="bfloat16", device=device, **QWEN35_27B)
                costs = {c.mode: c.seconds if c.feasible else None for c in plan.ranking}
                rows.append(
                    {"device": device, "seq_len": t, "cp": cp, "choice": plan.choice, "seconds": costs}
                )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """The mode the model picks, per (cp, T), one panel per device kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(MODES, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))
    for ax, device in zip(axes, ("gpu", "npu"), strict=True):
        for r in (r for r in rows if r["device"] == device):
            ax.scatter(r["cp"], r["seq_len"] / 1024, color=colors[r["choice"]], s=120, marker="s")
        for mode, color in colors.items():
            ax.scatter([], [], color=color, marker="s", label=mode)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="cp",
            ylabel="T (K tokens)",
            title=f"fastest mode, {device} link",
        )
        ax.set_xticks(FAR_CPS, [str(c) for c in FAR_CPS])
        ax.legend(fontsize=8)
    fig.suptitle("Qwen3.5-27B GDN heads (16 q/k, 48 v of 128), bf16: plan_context_parallel")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the measured layer")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8], help="rank counts measured")
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
        "--out", type=Path, default=Path("bench_scale"), help="folder for scale.json and scale.png"
    )
    args = parser.parse_args()
    if args.seq_len % max(args.cps) or min(args.cps) < 2 or args.repeats < 1:
        parser.error(
            f"--seq-len {args.seq_len} must divide by every --cps {args.cps} (each >= 2); --repeats >= 1"
        )
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    job = {"seq_len": args.seq_len, "repeats": args.repeats, "hidden": args.hidden, "heads": dict(zip(names, args.heads, strict=True))}  # fmt: skip
    measured = measured_rows(job, args.cps, args.timeout_s)
    far = predicted_rows()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(
        json.dumps({"job": job, "measured": measured, "predicted": far}, indent=1)
    )
    plot(far, args.out / "scale.png")
    print(
        f"{'cp':>3} {'mode':<10} {'bytes':>10} {'pred':>10} {'calls':>5} {'pred':>5} {'ms':>9} {'pred ms':>9}"
    )
    for r in measured:
        print(
            f"{r['cp']:>3} {r['mode']:<10} {r['bytes']:>10} {r['predicted_bytes']:>10.0f} {r['calls']:>5} "
            f"{r['predicted_messages']:>5.0f} {r['seconds'] * 1e3:>9.2f} {r['predicted_seconds'] * 1e3:>9.3f}"
        )
    print(f"wrote {args.out / 'scale.json'} and {args.out / 'scale.png'}")


if __name__ == "__main__":
    main()
