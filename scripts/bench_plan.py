"""The memory plan against measured peaks: per configuration, ``--plan``'s estimate for rank 0 and
the largest rank beside the peak resident memory of a real training step on each rank (CPU).

Two kinds of case, each on fresh forked ranks (gloo):

- ``trainer``: :class:`hyperpar_gdn.train.Trainer` itself (``--model-size``, byte tokens, p2p,
  one sequence per step, two steps: the second holds AdamW's state), the estimate from the same
  :class:`TrainConfig` through :mod:`hyperpar_gdn.train.memory_check`;
- ``qwen35``: the transformers Qwen3.5 model with the 248,320-token vocabulary
  (:func:`benchkit.memory_step.measure_step`, two steps), the estimate from its config.

Each case is ``kind:cp:dtype:ac:T`` (``ac`` or ``noac``); the defaults cover cp 1/2/4, AC on and
off, bf16 and the 248K vocabulary. Results: JSON (``--out``) with every rank's peak, the estimates
and the ratios estimate / measured; a table on stdout.

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
from benchkit.memory_step import VOCAB, measure_step
from benchkit.output import write_json
from benchkit.plan_step import TRAIN_OPTIONS, measure_trainer, write_text_data
from benchkit.ranks import on_ranks
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.memory_check import model_shape, step_options
from hyperpar_gdn.train.memory_plan import GIB, RUNTIME_BYTES, ModelShape, StepOptions, estimate

DEFAULT_CASES = (  # docs/training.md reports the first six; the last did not finish in its time there
    "trainer:1:fp32:noac:4096",
    "trainer:2:fp32:noac:4096",
    "trainer:1:fp32:ac:4096",
    "trainer:4:fp32:ac:8192",
    "qwen35:2:fp32:noac:1024",
    "trainer:2:bf16:noac:2048",
    "qwen35:1:bf16:ac:512",
)


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    cp: int
    dtype: str
    ac: bool
    seq_len: int

    @classmethod
    def parse(cls, text: str) -> Case:
        parts = text.split(":")
        if len(parts) != 5 or parts[0] not in ("trainer", "qwen35") or parts[3] not in ("ac", "noac"):
            raise SystemExit(f"case {text!r} is not kind:cp:dtype:ac:T (kind trainer or qwen35, ac or noac)")
        if parts[2] not in ("fp32", "bf16"):
            raise SystemExit(f"case {text!r}: dtype {parts[2]!r} is not fp32 or bf16")
        return cls(parts[0], int(parts[1]), parts[2], parts[3] == "ac", int(parts[4]))

    @property
    def name(self) -> str:
        return f"{self.kind} cp={self.cp} {self.dtype} {'AC' if self.ac else 'no AC'} T={self.seq_len}"


def qwen35_shape(hidden: int, layers: int) -> ModelShape:
    """The sizes of :func:`benchkit.memory_step.build_model`'s model (without building it)."""
    heads = max(1, hidden // 64)
    return ModelShape(
        vocab_size=VOCAB,
        hidden_size=hidden,
        layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ),
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
    )


def run_case(case: Case, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """Measure one case on its ranks; the estimates of rank 0 and of every rank."""
    threads = max(1, args.total_threads // case.cp)
    if case.kind == "trainer":
        options = {
            "seq_len": case.seq_len,
            "dtype": case.dtype,
            "ac": case.ac,
            "model_size": args.model_size,
            "data": str(data),
        }
        config = TrainConfig(**{**TRAIN_OPTIONS, **options, "cp_size": case.cp})
        shape, opts = model_shape(config), step_options(config, case.cp, platform="cpu")
        job = {"options": options}
        ranks = on_ranks(measure_trainer, case.cp, job, threads=threads, timeout_s=args.timeout_s)
    else:
        shape = qwen35_shape(args.hidden, args.layers)
        opts = StepOptions(
            seq_len=case.seq_len,
            cp=case.cp,
            world_size=case.cp,
            ac=case.ac,
            dtype=case.dtype,
            runtime_bytes=RUNTIME_BYTES["torch+transformers"],
        )
        job = {"hidden": args.hidden, "layers": args.layers, "ac": case.ac, "steps": 2, "loss": "chunked"}
        job.update(dtype=case.dtype, seq_len=case.seq_len)
        ranks = on_ranks(measure_step, case.cp, job, threads=threads, timeout_s=args.timeout_s)
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
    lines = [f"{'case':<34}{'rank 0 est/meas':>20}{'ratio':>8}{'largest est/meas':>20}{'ratio':>8}"]
    for row in rows:
        cells = []
        for key in ("rank0", "largest"):
            part = row[key]
            cells.append(
                f"{part['estimate'] / GIB:>9.2f} /{part['measured'] / GIB:>6.2f} GiB{part['ratio']:>8.3f}"
            )
        lines.append(f"{row['name']:<34}" + "".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="kind:cp:dtype:ac:T each")
    parser.add_argument("--model-size", default="small", help="the trainer cases' --model-size")
    parser.add_argument("--hidden", type=int, default=256, help="qwen35 cases: hidden size (multiple of 64)")
    parser.add_argument("--layers", type=int, default=4, help="qwen35 cases: decoder layers")
    parser.add_argument("--total-threads", type=int, default=2, help="split over the ranks")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="seconds per case")
    parser.add_argument("--out", type=Path, default=Path("bench_plan.json"), help="JSON file of the results")
    args = parser.parse_args(argv)
    cases = [Case.parse(text) for text in args.cases]
    keep_host_memory(True)  # as scripts/train.py on the CPU; forked ranks inherit it
    result: dict[str, Any] = {"machine": machine_info(), "memory_kind": "peak RSS", "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_text_data(Path(tmp) / "data.txt", max(c.seq_len for c in cases) + 1)
        for case in cases:
            result["cases"].append(run_case(case, args, data))
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
