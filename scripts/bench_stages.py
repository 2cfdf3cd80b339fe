"""Where a state mode's time goes: one GDN layer at cp ranks, stage by stage (forward, backward).

Per (mode, layout), forked gloo ranks of one thread each run :func:`benchkit.cp_stages.
measure_stages`: the layer's context-parallel pipeline cut into stages (projections, conv halo,
layout reorder, chunk prep, summary, exchange, correction, finish), each stage's forward and
backward timed after a barrier in alternating rounds, and the whole layer's step beside them.
A stage's time is the median over rounds of the slowest rank. The summary's and the exchange's
inherent FLOPs (:func:`benchkit.cp_stages.summary_flops`) are printed beside their times; the
stages' output must equal the layer's (``max_abs_diff``, fp32).

Usage (a quiet machine; the defaults are the benchmark layer of ``bench_cp``)::

    python scripts/bench_stages.py --seq-len 8192 --cp 2 --repeats 5
    python scripts/bench_stages.py --seq-len 256 --repeats 1 --warmup 0   # a smoke run

JSON (``--out``) and a PNG of stacked stage times beside it.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchkit.cp_layer import LayerShape
from benchkit.cp_stages import STAGES, measure_stages, summary_flops
from benchkit.machine import load_average, machine_info
from benchkit.output import Panel, save_png, write_json
from benchkit.ranks import on_ranks
from benchkit.timing import slowest_per_round
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.planning.plan import LAYOUTS, STATE_MODES

MODES = STATE_MODES  # the stages are those of the state-passing modes
AGREEMENT = 1e-4  # max |stages - layer| (fp32): the same operations in the same order


def stage_table(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """name -> median over rounds of the slowest rank's seconds (ranks lacking a stage skipped)."""
    names = {name for r in ranks for name in r["times_s"]}
    return {
        name: statistics.median(
            slowest_per_round([r["times_s"][name] for r in ranks if name in r["times_s"]])
        )
        for name in sorted(names)
    }


def print_table(mode: str, layout: str, table: dict[str, float], flops: dict[str, int]) -> None:
    print(f"\n{mode} / {layout}        fwd ms    bwd ms   inherent GFLOP (fwd, bwd)")
    total = 0.0
    for stage in STAGES:
        if f"{stage}/fwd" not in table:
            continue
        fwd, bwd = table[f"{stage}/fwd"], table[f"{stage}/bwd"]
        total += fwd + bwd
        extra = ""
        if stage in ("summary", "exchange"):
            extra = f"   {flops[f'{stage}_forward'] / 1e9:.3f}, {flops[f'{stage}_backward'] / 1e9:.3f}"
        print(f"  {stage:16s} {1e3 * fwd:9.1f} {1e3 * bwd:9.1f}{extra}")
    print(f"  {'sum of stages':16s} {1e3 * total:19.1f}")
    print(f"  {'layer step':16s} {1e3 * table['layer']:19.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192, help="total sequence length T")
    parser.add_argument("--cp", type=int, default=2, help="ranks of the CP group")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="state modes to profile"
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="token layouts to profile"
    )
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk size of the gated delta rule")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/bench_stages.json"),
        help="JSON to write (the PNG beside it)",
    )
    args = parser.parse_args()
    shape = LayerShape()
    if args.seq_len % (2 * args.cp):
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by 2*cp = {2 * args.cp} (head_tail)")
    flops = {
        mode: summary_flops(
            shape, local_len=args.seq_len // args.cp, chunk_size=args.chunk_size, cp=args.cp, mode=mode
        )
        for mode in args.modes
    }
    payload: dict[str, Any] = {
        "machine": machine_info(),
        "load_before": load_average(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "shape": asdict(shape),
        "inherent_flops": flops,
        "results": [],
    }
    panels = []
    for layout in args.layouts:
        for mode in args.modes:
            job = {
                "mode": mode,
                "layout": layout,
                "seq_len": args.seq_len,
                "chunk_size": args.chunk_size,
                "shape": asdict(shape),
                "repeats": args.repeats,
                "warmup": args.warmup,
            }
            ranks = on_ranks(measure_stages, args.cp, job, timeout_s=3600)
            table = stage_table(ranks)
            diff = max(r["max_abs_diff"] for r in ranks)
            if diff > AGREEMENT:
                raise SystemExit(
                    f"{mode}/{layout}: the stages' output differs from the layer's by {diff:.3g}"
                )
            print_table(mode, layout, table, flops[mode])
            payload["results"].append(
                {"mode": mode, "layout": layout, "max_abs_diff": diff, "median_s": table, "ranks": ranks}
            )
            payload["load_after"] = load_average()
            write_json(args.out, payload)
            bars = {
                f"{stage[:6]}/{part}": (1e3 * table[f"{stage}/{part}"], f"C{i}")
                for i, stage in enumerate(STAGES)
                for part in ("fwd", "bwd")
                if f"{stage}/{part}" in table
            }
            panels.append(
                Panel(f"{mode} / {layout}, cp={args.cp}, T={args.seq_len}", "stage", "ms", bars=bars)
            )
    save_png(args.out.with_suffix(".png"), panels, width=7.0)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}; load {load_average()[0]:.1f}")


if __name__ == "__main__":
    main()
