"""``bench_plan``'s measurement: the peak resident memory of every rank over a few steps of the real
trainer (:class:`hyperpar_gdn.train.Trainer`: the built-in model on byte tokens of a generated text
file, or a transformers model directory with its tokenizer), on ranks of
:func:`benchkit.ranks.on_ranks` (fresh processes: a peak is not hidden by an earlier one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchkit.machine import peak_rss_bytes, rss_bytes

__all__ = ["TRAIN_OPTIONS", "measure_trainer", "write_model_dir", "write_text_data"]

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


def write_model_dir(rank: int, cp: int, job: dict[str, Any]) -> str:
    """One rank: a random transformers Qwen3.5 directory at ``job["out"]`` (``job["moe"]``,
    ``job["sizes"]``). Written in a rank of its own: whatever the parent process allocated, its
    forked measuring ranks would count as resident memory."""
    from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35

    return str(write_tiny_qwen35(job["out"], moe=job["moe"], sizes=job["sizes"]))
