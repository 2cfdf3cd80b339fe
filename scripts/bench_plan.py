"""The memory plan against measured peaks: per configuration, ``--plan``'s estimate for rank 0 and
the largest rank beside the peak resident memory of a real training step on each rank (CPU).

Every case runs :class:`hyperpar_gdn.train.Trainer` itself on fresh forked ranks (gloo, p2p, one
sequence per step, two steps: the second holds AdamW's state), and the estimate comes from the
same :class:`TrainConfig` through :mod:`hyperpar_gdn.train.memory_check`. Three models:

- ``trainer``: the built-in model (``--model-size``), byte tokens;
- ``qwen35``: a transformers Qwen3.5 directory with the 248,320-token vocabulary
  (:func:`benchkit.memory_step.qwen35_sizes`, ``--hidden`` x ``--layers``, random weights);
- ``moe``: the same as a Qwen3.5-MoE (``--experts`` experts, 2 per token, a shared expert).

Each case is ``kind:cp:dtype:flags:T`` with flags ``noac``, ``ac``, ``fsdp`` or ``ac+fsdp``; the
defaults cover cp 1/2/4, AC on and off, bf16, FSDP, T = 16K, MoE and the 248K vocabulary.
Results: JSON (``--out``) with every rank's peak, the estimates and the ratios estimate /
measured; a table on stdout.

Usage: ``python scripts/bench_plan.py --out bench_plan.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchkit.machine import keep_host_memory, load_average, machine_info
from benchkit.memory_step import qwen35_sizes
from benchkit.output import write_json
from benchkit.plan_step import TRAIN_OPTIONS, measure_trainer, write_model_dir, write_text_data
from benchkit.ranks import on_ranks
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.planning.memory import GIB, estimate
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.memory_check import model_shape, step_options

DEFAULT_CASES = (
    "qwen35:2:fp32:noac:1024",
    "qwen35:1:fp32:ac:1024",
    "trainer:1:fp32:noac:4096",
    "trainer:2:fp32:noac:4096",
    "trainer:1:fp32:ac:4096",
    "trainer:2:bf16:noac:2048",
    "trainer:2:fp32:fsdp:4096",
    "moe:2:fp32:noac:2048",
    "trainer:4:fp32:noac:16384",
    "trainer:4:fp32:ac:16384",
)
KINDS, FLAGS = ("trainer", "qwen35", "moe"), ("noac", "ac", "fsdp", "ac+fsdp")


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    cp: int
    dtype: str
    ac: bool
    fsdp: bool
    seq_len: int

    @classmethod
    def parse(cls, text: str) -> Case:
        parts = text.split(":")
        if len(parts) != 5 or parts[0] not in KINDS or parts[3] not in FLAGS:
            raise SystemExit(f"case {text!r} is not kind:cp:dtype:flags:T (kind {KINDS}, flags {FLAGS})")
        if parts[2] not in ("fp32", "bf16"):
            raise SystemExit(f"case {text!r}: dtype {parts[2]!r} is not fp32 or bf16")
        flags = parts[3].split("+")
        return cls(parts[0], int(parts[1]), parts[2], "ac" in flags, "fsdp" in flags, int(parts[4]))

    @property
    def name(self) -> str:
        flags = ("AC" if self.ac else "no AC") + (" FSDP" if self.fsdp else "")
        return f"{self.kind} cp={self.cp} {self.dtype} {flags} T={self.seq_len}"


def write_models(root: Path, kinds: set[str], args: argparse.Namespace) -> dict[str, str]:
    """The transformers directories of the ``qwen35`` and ``moe`` cases that run (random weights),
    each written by a process of its own (this one stays as small as the ranks it forks)."""
    dirs = {}
    for kind in sorted(kinds & {"qwen35", "moe"}):
        sizes = qwen35_sizes(args.hidden, args.layers, experts=args.experts if kind == "moe" else 0)
        job = {"out": str(root / kind), "moe": kind == "moe", "sizes": sizes}
        dirs[kind] = on_ranks(write_model_dir, 1, job, timeout_s=args.timeout_s)[0]
    return dirs


def run_case(case: Case, args: argparse.Namespace, data: Path, models: dict[str, str]) -> dict[str, Any]:
    """Measure one case on its ranks; the estimates of rank 0 and of every rank."""
    threads = max(1, args.total_threads // case.cp)
    options: dict[str, Any] = {"seq_len": case.seq_len, "dtype": case.dtype, "ac": case.ac, "data": str(data)}
    options.update(fsdp=case.fsdp)
    if case.kind == "trainer":
        options["model_size"] = args.model_size
    else:
        options["model_dir"] = models[case.kind]
    config = TrainConfig(**{**TRAIN_OPTIONS, **options, "cp_size": case.cp})
    shape, opts = model_shape(config), step_options(config, case.cp, platform="cpu")
    job = {"options": options}
    ranks = on_ranks(measure_trainer, case.cp, job, threads=threads, timeout_s=args.timeout_s)
    estimates = [estimate(shape, opts, rank=r) for r in range(case.cp)]
    peaks = [r["peak"] for r in ranks]
    largest = max(range(case.cp), key=lambda r: peaks[r])
    worst = max(estimates, key=lambda e: e.total)
    return {
        **dataclasses.asdict(case),
        "name": case.name,
        "peaks": peaks,
        "estimates": [e.total for e in estimates],
        "terms_rank0": estimates[0].terms,
        "rank0": {
            "estimate": estimates[0].total,
            "measured": peaks[0],
            "ratio": estimates[0].total / peaks[0],
        },
        "largest": {
            "estimate": worst.total,
            "estimate_rank": worst.rank,
            "measured": peaks[largest],
            "measured_rank": largest,
            "ratio": worst.total / peaks[largest],
        },
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per case: rank 0 and the largest rank, estimate / measured (GiB) and the ratio."""
    lines = [f"{'case':<40}{'rank 0 est/meas':>20}{'ratio':>8}{'largest est/meas':>20}{'ratio':>8}"]
    for row in rows:
        cells = []
        for key in ("rank0", "largest"):
            part = row[key]
            cells.append(
                f"{part['estimate'] / GIB:>9.2f} /{part['measured'] / GIB:>6.2f} GiB{part['ratio']:>8.3f}"
            )
        lines.append(f"{row['name']:<40}" + "".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="kind:cp:dtype:flags:T each")
    parser.add_argument("--model-size", default="small", help="the trainer cases' --model-size")
    parser.add_argument(
        "--hidden", type=int, default=256, help="qwen35 and moe cases: hidden size (multiple of 64)"
    )
    parser.add_argument("--layers", type=int, default=4, help="qwen35 and moe cases: decoder layers")
    parser.add_argument("--experts", type=int, default=8, help="moe cases: experts per MoE layer")
    parser.add_argument("--total-threads", type=int, default=2, help="split over the ranks")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="seconds per case")
    parser.add_argument("--out", type=Path, default=Path("bench_plan.json"), help="JSON file of the results")
    args = parser.parse_args(argv)
    cases = [Case.parse(text) for text in args.cases]
    keep_host_memory(True)  # as scripts/train.py on the CPU; forked ranks inherit it
    result: dict[str, Any] = {"machine": machine_info(), "memory_kind": "peak RSS", "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        # bytes for the built-in model; the model directories' tokenizer takes a few bytes a token
        data = write_text_data(Path(tmp) / "data.txt", 8 * max(c.seq_len for c in cases) + 1)
        models = write_models(Path(tmp), {c.kind for c in cases}, args)
        for case in cases:
            result["cases"].append(run_case(case, args, data, models))
            write_json(args.out, result)  # what is done so far
            print(table(result["cases"][-1:])[-1], flush=True)
    result["loadavg_end"] = load_average()
    write_json(args.out, result)
    print("\n".join(table(result["cases"])))
    worst = max(abs(r[k]["ratio"] - 1) for r in result["cases"] for k in ("rank0", "largest"))
    print(f"largest deviation of an estimate from its measured peak: {worst:.1%}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
