"""What a run records and prints: a record per step, the run's result, its log lines and the
``--metrics-json`` document. No framework here: the numbers come from the trainer and its backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepRecord", "TrainResult", "metrics_document", "step_line", "summary_lines"]


@dataclass
class StepRecord:
    """One optimizer step: the mean loss over the global batch, its wall time and throughput, this
    rank's peak memory so far, and the no-CP reference's loss under ``--check-parity``."""

    step: int
    loss: float
    seconds: float
    tokens_per_s: float
    peak_memory_bytes: int
    reference_loss: float | None = None
    skipped: bool = False  # a non-finite loss or gradient norm on some rank: no update


@dataclass
class TrainResult:
    """What a run did; rank 0's view (other ranks hold the same losses and parity verdict)."""

    records: list[StepRecord] = field(default_factory=list)
    start_step: int = 0
    wall_s: float = 0.0
    peak_memory_bytes: int = 0  # the largest over ranks
    memory_kind: str = ""
    parity_max_diff: float | None = None
    parity_first_bad_step: int | None = None
    parity_ok: bool = True

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self.records if r.skipped]

    @property
    def tokens_per_s(self) -> float:
        """Mean over the steps after the first (which includes one-off start-up work)."""
        timed = self.records[1:] or self.records
        return sum(r.tokens_per_s for r in timed) / max(len(timed), 1)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def step_line(record: StepRecord, steps: int, memory_kind: str) -> str:
    """``step  3/10 | loss 5.1234 | ... tok/s | peak ... | 0.123 s`` (and the reference's loss)."""
    width = len(str(steps))
    line = (
        f"step {record.step:>{width}}/{steps} | loss {record.loss:.4f} | {record.tokens_per_s:>9,.0f} tok/s | "
        f"peak {mib(record.peak_memory_bytes)} {memory_kind} | {record.seconds:.3f} s"
    )
    if record.skipped:
        line += " | skipped"
    if record.reference_loss is not None:
        line += f" | no-cp {record.reference_loss:.4f} (diff {abs(record.loss - record.reference_loss):.1e})"
    return line


def summary_lines(result: TrainResult, *, parity_tol: float) -> list[str]:
    """The lines that close a run: the totals, and the parity verdict under ``--check-parity``."""
    if not result.records:
        return []
    first, last = result.records[0], result.records[-1]
    lines = [
        f"done: steps {first.step}..{last.step} in {result.wall_s:.1f} s | loss {first.loss:.4f} -> "
        f"{last.loss:.4f} | {result.tokens_per_s:,.0f} tok/s | peak {mib(result.peak_memory_bytes)} "
        f"({result.memory_kind}, max over ranks)"
    ]
    if result.parity_max_diff is not None:
        verdict = "OK" if result.parity_ok else "FAILED"
        lines.append(
            f"parity {verdict}: largest |loss(cp) - loss(no cp)| over {len(result.records)} steps = "
            f"{result.parity_max_diff:.3g} (--parity-tol {parity_tol:.3g})"
        )
        if result.parity_first_bad_step is not None:
            lines.append(
                f"the difference first exceeded the tolerance at step {result.parity_first_bad_step}. A "
                "large first-step difference is a CP error; one that grows over many steps is two runs "
                "drifting apart (training amplifies rounding differences; see docs/training.md)"
            )
    return lines


def metrics_document(result: TrainResult, *, run: dict[str, Any], parity_tol: float | None) -> dict[str, Any]:
    """The ``--metrics-json`` document: the per-step series, the totals, the parity verdict
    (``parity_tol`` None: no ``--check-parity``) and ``run`` (platform, sizes, options, model)."""
    parity = None
    if parity_tol is not None:
        parity = {
            "reference_losses": [r.reference_loss for r in result.records],
            "max_abs_diff": result.parity_max_diff,
            "first_step_above_tolerance": result.parity_first_bad_step,
            "tolerance": parity_tol,
            "ok": result.parity_ok,
        }
    series = {
        "losses": result.losses,
        "steps": [r.step for r in result.records],
        "start_step": result.start_step,
        "skipped_steps": result.skipped_steps,
        "step_seconds": [r.seconds for r in result.records],
        "tokens_per_s_per_step": [r.tokens_per_s for r in result.records],
        "tokens_per_s": result.tokens_per_s,
        "peak_memory_bytes": result.peak_memory_bytes,
        "memory_kind": result.memory_kind,
        "wall_s": result.wall_s,
    }
    about = {k: v for k, v in run.items() if k not in ("config", "model")}
    return {**series, **about, "parity": parity, "config": run["config"], "model": run["model"]}
