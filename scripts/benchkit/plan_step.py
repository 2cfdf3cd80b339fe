"""``bench_plan``'s measurement: the peak resident memory of every rank over a few steps of the real
trainer (:class:`hyperpar_gdn.train.Trainer`, the built-in model, byte tokens of a generated text
file), on ranks of :func:`benchkit.ranks.on_ranks` (fresh processes: a peak is not hidden by an
earlier one). The Qwen3.5 model with the 248,320-token vocabulary is measured by
:func:`benchkit.memory_step.measure_step` instead (the trainer's byte data cannot feed it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchkit.machine import peak_rss_bytes, rss_bytes

__all__ = ["TRAIN_OPTIONS", "measure_trainer", "write_text_data"]

# What every measured run shares: one sequence per step, the p2p mode, quiet logs.
TRAIN_OPTIONS = {"batch_size": 1, "cp_mode": "p2p", "steps": 2, "log_every": 1000, "warmup_steps": 0}


def write_text_data(path: Path, tokens: int) -> Path:
    """A text file of at least ``tokens`` bytes (byte tokens), deterministic."""
    line = "the gated delta rule keeps a state that every token updates and reads. "
    path.write_text(line * (tokens // len(line) + 2))
    return path


def measure_trainer(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank: the trainer with ``job["options"]`` (TrainConfig fields) for its steps; the
    resident memory after building, the peak and the seconds."""
    import time

    from hyperpar_gdn.train import TrainConfig, Trainer

    config = TrainConfig(**{**TRAIN_OPTIONS, **job["options"], "cp_size": cp})
    trainer = Trainer(config)
    try:
        built = rss_bytes()
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    finally:
        trainer.close()
    return {"rank": rank, "rss_built": built, "peak": peak_rss_bytes(), "seconds": seconds}
