"""Peak memory per rank of one whole training step of a transformers Qwen3.5 model with Qwen3.5's
248,320-token vocabulary, under context parallelism, on torch (CPU: peak RSS; CUDA: the allocator).

One step is what ``scripts/train.py`` does: the CP shard of a [1, T] batch, the model (p2p CP on
its GDN layers, all-gathered K/V on its attention layers, ``--ac`` checkpointing per layer), the
chunked LM loss from the final hidden states (:func:`hyperpar_gdn.ops.lm_loss.lm_loss_sum`, as the
trainer), backward, the gradient all-reduce over the CP group and an AdamW step. Every measurement
runs in freshly forked ranks (gloo), so a step's peak is not hidden by an earlier one. Three parts:

- ``table``: cp in ``--cp-sizes`` x ``--dtypes`` (fp32, bf16 autocast) at ``--seq-len``;
- ``search``: per cp, the longest T (a multiple of ``--t-step`` x cp) whose step fits
  ``--budget-gib`` per rank: doubling from ``--seq-len``, then bisection;
- ``loss``: the chunked loss against the logits path (``[1, T, V]`` logits and cross-entropy, what
  the trainer did before) at ``--seq-len`` on one rank, for the whole step and for the loss alone
  (forward and backward of the loss from fixed hidden states): peak growth and time, in turns
  (``--repeats`` rounds, fresh processes, medians).

The measurements are in :mod:`benchkit.memory_step`.

Results: JSON (``--out``) and a plot of peak memory per rank against T beside it.

Usage: ``python scripts/bench_memory.py --ac --seq-len 2048 --cp-sizes 1 2 4 --budget-gib 4``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchkit.machine import load_average
from benchkit.memory_step import VOCAB, measure_loss, measure_step
from benchkit.output import Panel, save_png, write_json
from benchkit.ranks import on_ranks
from hyperpar_gdn.cli import HelpFormatter

PARTS = ("table", "loss", "search")
GIB = 2**30


def run_step(cp: int, **job: Any) -> dict[str, Any]:
    """One configuration on ``cp`` fresh ranks; the largest peak over the ranks."""
    ranks = on_ranks(measure_step, cp, job, threads=job["threads"], timeout_s=job["timeout_s"])
    return {
        **{k: v for k, v in job.items() if k != "timeout_s"},
        "cp": cp,
        "peak_per_rank": max(r["peak"] for r in ranks),
        "growth_per_rank": max(r["growth"] for r in ranks),
        "step_seconds": statistics.median(
            max(r["seconds"][i] for r in ranks) for i in range(len(ranks[0]["seconds"]))
        ),
    }


def search_longest(
    cp: int, budget: int, job: dict[str, Any], *, start: int, t_step: int, limit: int
) -> dict[str, Any]:
    """The longest T (a multiple of t_step * cp) whose step peaks within ``budget`` per rank."""
    unit = t_step * cp
    probes: list[dict[str, Any]] = []

    def fits(t: int) -> bool:
        row = run_step(cp, **{**job, "seq_len": t})
        probes.append(row)
        print(f"  search cp={cp} T={t}: peak {row['peak_per_rank'] / GIB:.2f} GiB per rank", flush=True)
        return row["peak_per_rank"] <= budget

    lo, hi = 0, max(unit, start // unit * unit)
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + unit)
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"cp": cp, "longest_seq_len": lo, "budget_bytes": budget, "probes": probes}


def compare_losses(job: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The chunked loss against the logits path, whole step and loss alone, in turns."""
    out: dict[str, Any] = {}
    for part, target in (("step", measure_step), ("loss_alone", measure_loss)):
        rows: dict[str, list[dict[str, Any]]] = {"logits": [], "chunked": []}
        for _ in range(repeats):
            for loss in ("logits", "chunked"):
                result = on_ranks(
                    target, 1, {**job, "loss": loss}, threads=job["threads"], timeout_s=job["timeout_s"]
                )[0]
                rows[loss].append(result)
        summary = {
            loss: {
                "growth": statistics.median(r["growth"] for r in rs),
                "seconds": statistics.median(s for r in rs for s in r["seconds"][-1:]),
            }
            for loss, rs in rows.items()
        }
        summary["growth_ratio"] = summary["chunked"]["growth"] / summary["logits"]["growth"]
        summary["time_ratio"] = summary["chunked"]["seconds"] / summary["logits"]["seconds"]
        out[part] = summary
        print(
            f"  {part}: growth {summary['logits']['growth'] / GIB:.2f} -> {summary['chunked']['growth'] / GIB:.2f} GiB "
            f"(x{summary['growth_ratio']:.2f}), time {summary['logits']['seconds']:.2f} -> "
            f"{summary['chunked']['seconds']:.2f} s (x{summary['time_ratio']:.2f})",
            flush=True,
        )
    return out


def panel(result: dict[str, Any]) -> Panel:
    """Peak memory per rank against T of every search probe, and the budget."""
    out = Panel(
        f"Qwen3.5 V=248,320, hidden {result['hidden']}, {result['layers']} layers, --ac",
        "T (tokens)",
        "peak memory per rank (GiB)",
        hlines={"budget": (result["budget_gib"], "--")},
        log2_x=True,
    )
    for entry in result["search"]:
        out.lines[f"cp={entry['cp']}"] = [(r["seq_len"], r["peak_per_rank"] / GIB) for r in entry["probes"]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048, help="T of the table and the loss comparison")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="CP sizes of the table")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["fp32", "bf16"],
        default=["fp32", "bf16"],
        help="compute dtypes of the table",
    )
    parser.add_argument("--ac", action="store_true", help="activation checkpointing per decoder layer")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (multiple of 64)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="per-rank budget of the search (default: none, no search)",
    )
    parser.add_argument("--t-step", type=int, default=256, help="the search's T is a multiple of this x cp")
    parser.add_argument("--t-limit", type=int, default=1 << 16, help="the search stops at this T")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the loss comparison (0: skip)")
    parser.add_argument("--steps", type=int, default=2, help="steps per measurement (the first one's peak)")
    parser.add_argument("--total-threads", type=int, default=2, help="split over the ranks")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="seconds per measurement process")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure")
    parser.add_argument(
        "--out", type=Path, default=Path("bench_memory.json"), help="JSON file of the results"
    )
    args = parser.parse_args(argv)
    if args.hidden % 64:
        raise SystemExit(f"--hidden {args.hidden} must be a multiple of 64")
    base = {
        "hidden": args.hidden,
        "layers": args.layers,
        "ac": args.ac,
        "steps": args.steps,
        "loss": "chunked",
        "dtype": "fp32",
        "timeout_s": args.timeout_s,
    }
    result: dict[str, Any] = {
        "vocab": VOCAB,
        "hidden": args.hidden,
        "layers": args.layers,
        "ac": args.ac,
        "memory_kind": "peak RSS",
        "loadavg_start": load_average(),
        "table": [],
        "search": [],
    }
    for cp in args.cp_sizes if "table" in args.parts else ():
        for dtype in args.dtypes:
            threads = max(1, args.total_threads // cp)
            row = run_step(cp, **{**base, "dtype": dtype, "seq_len": args.seq_len, "threads": threads})
            result["table"].append(row)
            write_json(args.out, result)
            print(
                f"cp={cp} {dtype} T={args.seq_len}: peak {row['peak_per_rank'] / GIB:.2f} GiB per rank "
                f"(step growth {row['growth_per_rank'] / GIB:.2f} GiB), {row['step_seconds']:.2f} s",
                flush=True,
            )
    if args.repeats and "loss" in args.parts:
        job = {**base, "seq_len": args.seq_len, "threads": args.total_threads}
        result["loss_vs_logits"] = compare_losses(job, args.repeats)
        write_json(args.out, result)
    if args.budget_gib is not None and "search" in args.parts:
        result["budget_gib"] = args.budget_gib
        for cp in args.cp_sizes:
            job = {**base, "steps": 1, "threads": max(1, args.total_threads // cp)}
            entry = search_longest(
                cp,
                int(args.budget_gib * GIB),
                job,
                start=args.seq_len,
                t_step=args.t_step,
                limit=args.t_limit,
            )
            result["search"].append(entry)
            write_json(args.out, result)  # what is done so far
            print(
                f"cp={cp}: longest T within {args.budget_gib} GiB per rank: {entry['longest_seq_len']}",
                flush=True,
            )
    result["loadavg_end"] = load_average()
    write_json(args.out, result)
    if result["search"]:
        save_png(args.out.with_suffix(".png"), [panel(result)], width=6, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
