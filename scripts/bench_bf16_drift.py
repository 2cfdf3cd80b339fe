"""bf16 drift of the GDN CP modes: each mode's error against an fp64 one-device run, beside ulysses'.

One GDN layer with bf16 weights and bf16 inputs (as users run it; no autocast), contiguous shards
of T/cp tokens on forked gloo ranks (one thread each), every mode in ``--modes``; the truth is the
same bf16-rounded layer, input and output gradient in fp64 on one device (:mod:`benchkit.bf16_drift`).
Per mode and tensor (output, input gradient, every parameter gradient summed over ranks in fp64):
the relative error ``max|got - truth| / max|truth|`` and its RMS version, the bf16 one-device run's
beside them, and per summary mode the worst ratio to ulysses' error (the target: <= 1.2). JSON
(``--out``) is written once the ranks finish; nothing here is timed.

    PYTHONPATH=. python scripts/bench_bf16_drift.py --seq-len 32768 --cp 8 --out results/bf16_drift.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchkit.bf16_drift import MODES, DriftShape, drift, run_modes, truth, worst_ratios
from benchkit.machine import machine_info
from benchkit.output import write_json
from benchkit.ranks import on_ranks
from hyperpar_gdn.cli import HelpFormatter

TARGET = 1.2  # a summary mode's error may be at most this multiple of ulysses'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768, help="tokens of the whole sequence")
    parser.add_argument("--cp", type=int, default=8, help="ranks (gloo, one thread each)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="ulysses first")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="seconds for the ranks")
    parser.add_argument("--out", type=Path, default=Path("results/bf16_drift.json"), help="JSON path")
    args = parser.parse_args()
    shape = DriftShape()
    if args.cp < 2 or args.seq_len % args.cp:
        parser.error(f"--cp {args.cp} must be >= 2 and divide --seq-len {args.seq_len}")
    if args.modes[0] != "ulysses" or shape.num_v_heads % args.cp:
        parser.error(
            f"--modes {args.modes} must start with ulysses, which needs cp | {shape.num_v_heads} heads"
        )
    reference = truth(shape, args.seq_len)
    per_rank = on_ranks(run_modes, args.cp, shape, args.seq_len, tuple(args.modes), timeout_s=args.timeout_s)
    errors = drift(per_rank, reference)
    ratios = {metric: worst_ratios(errors, metric=metric) for metric in ("max", "rms")}
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "seq_len": args.seq_len,
            "cp": args.cp,
            "shape": vars(shape),
            "precision": "bf16 weights and inputs; states, summaries and compositions fp32",
            "errors": errors,
            "worst_ratio_to_ulysses": ratios,
            "target": TARGET,
        },
    )
    print(f"T={args.seq_len} cp={args.cp}: relative error against fp64 one device (max-abs / RMS)")
    tensors = (
        "output",
        "grad_input",
        *sorted(k for k in errors["ulysses"] if k.startswith("grad_") and k != "grad_input"),
    )
    for key in tensors:
        cells = "  ".join(f"{m} {e[key]['max']:.2e}/{e[key]['rms']:.2e}" for m, e in errors.items())
        print(f"{key:<28} {cells}")
    for metric, worst in ratios.items():
        line = ", ".join(f"{m} {r:.3f} ({k})" for m, (k, r) in worst.items())
        print(f"worst {metric} ratio to ulysses (target <= {TARGET}): {line}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
