"""Per-rank memory of one training step at tp = 1 and tp = 2: measured beside the memory plan.

A Qwen3.5-shaped transformers model (:mod:`benchkit.tp_memory`: three GDN layers and one softmax
attention layer per four, Qwen3.5's head ratios, fp32) takes one step (forward with the chunked
LM loss, backward, AdamW) on ``tp`` forked gloo ranks (tensor parallelism over all of them, the
library's GDN layer at every tp). Per tp, the largest rank's: parameters it holds (all, and the
decoder layers' matrices), the bytes autograd saved in the forward, the resident memory's peak
and its growth over the step; beside them ``hyperpar_gdn.planning.memory.estimate`` at that tp
(parameters, activations, the step's total without the runtime). Memory does not depend on the
machine's load; the seconds do (printed, not a claim).

Usage: ``python scripts/bench_tp_memory.py --seq-len 8192 --out bench_tp_memory``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchkit.machine import load_average, machine_info
from benchkit.output import write_json
from benchkit.ranks import on_ranks
from benchkit.tp_memory import measure_tp_step, planned
from hyperpar_gdn.cli import HelpFormatter

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens of the step (one sequence)")
    parser.add_argument("--hidden", type=int, default=512, help="model width (a multiple of 256)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th attention)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (tied head)")
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2], help="TP sizes, each a run")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("bench_tp_memory"), help="folder for tp_memory.json")
    args = parser.parse_args()
    if args.hidden % 256 or args.seq_len < 64 or min(args.tps) < 1:
        parser.error(f"--hidden {args.hidden} must divide by 256, --seq-len {args.seq_len} >= 64, --tps >= 1")
    job = {"seq_len": args.seq_len, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    result = {"machine": machine_info(), "job": job, "runs": []}
    for tp in args.tps:
        ranks = on_ranks(measure_tp_step, tp, job, timeout_s=args.timeout_s)
        worst = {k: max(r[k] for r in ranks) for k in ("parameters", "layer_matrices", "saved_activations")}
        worst["peak"] = max(r["peak"] for r in ranks)
        worst["growth"] = max(r["peak"] - r["rss_before"] for r in ranks)
        worst["seconds"] = max(r["seconds"] for r in ranks)
        result["runs"].append({"tp": tp, "measured": worst, "plan": planned(job, tp), "ranks": ranks})
        write_json(args.out / "tp_memory.json", result)
    base = result["runs"][0]
    print(f"{'tp':>3} {'params MiB':>10} {'plan':>7} {'x tp1':>6} {'layers x':>8} {'saved MiB':>9} "
          f"{'plan act':>8} {'x tp1':>6} {'peak MiB':>8} {'growth':>7} {'plan step':>9} {'s':>6}")  # fmt: skip
    for run in result["runs"]:
        m, p = run["measured"], run["plan"]
        step = p["total"] - p["runtime"] - p["parameters"]  # what the step adds once the model exists
        print(
            f"{run['tp']:>3} {m['parameters'] / MIB:>10.1f} {p['parameters'] / MIB:>7.1f} "
            f"{m['parameters'] / base['measured']['parameters']:>6.3f} "
            f"{m['layer_matrices'] / base['measured']['layer_matrices']:>8.3f} "
            f"{m['saved_activations'] / MIB:>9.0f} {p['activations'] / MIB:>8.0f} "
            f"{m['saved_activations'] / base['measured']['saved_activations']:>6.3f} "
            f"{m['peak'] / MIB:>8.0f} {m['growth'] / MIB:>7.0f} {step / MIB:>9.0f} {m['seconds']:>6.1f}"
        )
    print(f"load average {load_average()[0]:.1f}; wrote {args.out / 'tp_memory.json'}")


if __name__ == "__main__":
    main()
