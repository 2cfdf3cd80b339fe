"""Host memory of a checkpoint save, per rank: the sharded format (every rank writes its shard,
torch's DCP) against the whole format (rank 0 gathers and writes everything), under ``--fsdp``.

Each format runs in fresh forked ranks (gloo): the trainer of ``scripts/train.py`` trains
``--steps`` steps of ``--model-size`` at ``--ranks`` ranks (``--cp-size``), then saves once more
while each rank watches its resident memory: the peak (``VmHWM``) is reset just before the save
(``/proc/self/clear_refs``), so the growth is ``VmHWM`` after the save minus ``VmRSS`` before it.
The reference in the same run: the state's bytes (weights and two AdamW moments, fp32), which the
whole format must hold on rank 0, and the checkpoint's files on disk (their sum is that state
either way). Times are not reported (a save's speed is the disk's, and this machine is shared).

Usage: ``python scripts/bench_checkpoint.py --model-size small --out results/bench_checkpoint.json``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchkit.machine import load_average
from benchkit.output import write_json
from benchkit.ranks import on_ranks
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.train import TrainConfig, Trainer
from hyperpar_gdn.train.checkpoints.directory import list_checkpoints

FORMATS = ("sharded", "whole")
MIB = 2**20


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Set this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _worker(rank: int, world: int, options: dict[str, Any], root: str) -> dict[str, Any]:
    trainer = Trainer(TrainConfig(**options, save=root))
    try:
        trainer.train()  # saves step-N once: DCP's plans and buffers are warm, as in a long run
        small = {"data": trainer.sampler.state_dict(), "train": {"step": trainer.step}}
        torch.distributed.barrier()
        _reset_peak()
        before = _status_kib("VmRSS")
        trainer.writer.save(trainer.step + 1, small)
        peak = _status_kib("VmHWM")
        numel = sum(p.numel() for p in trainer.model.parameters())  # DTensors: the whole parameter
    finally:
        trainer.close()
    return {
        "rss_before_mib": before / 1024,
        "peak_mib": peak / 1024,
        "growth_mib": (peak - before) / 1024,
        "numel": numel,
    }


def measure(fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "model_size": args.model_size,
        "seq_len": args.seq_len,
        "batch_size": args.ranks // args.cp_size,
        "steps": args.steps,
        "cp_size": args.cp_size,
        "cp_mode": "p2p",
        "fsdp": True,
        "checkpoint_format": fmt,
        "log_every": args.steps,
    }
    with tempfile.TemporaryDirectory(dir=args.tmp) as root:
        ranks = on_ranks(_worker, args.ranks, options, root)
        last = list_checkpoints(root)[-1][1]
        files = {str(p.relative_to(last)): p.stat().st_size for p in sorted(last.rglob("*")) if p.is_file()}
    state_numel = ranks[0]["numel"]
    return {
        "format": fmt,
        "ranks": ranks,
        "state_mib": 3 * 4 * state_numel / MIB,  # fp32 weights, exp_avg, exp_avg_sq
        "files_mib": {name: size / MIB for name, size in files.items()},
        "largest_file_share": max(files.values()) / sum(files.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--model-size", default="small", help="the built-in model preset")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (forked, one thread each)")
    parser.add_argument("--cp-size", type=int, default=2, help="ranks per CP group (the rest: DP)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=1, help="training steps before the measured save")
    parser.add_argument(
        "--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="formats to measure"
    )
    parser.add_argument("--tmp", default=None, help="where the checkpoints go (default: the system's temp)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_checkpoint.json"), help="JSON output")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"load_average": load_average(), "options": vars(args) | {"out": str(args.out)}}
    for fmt in args.formats:
        results[fmt] = measure(fmt, args)
        write_json(args.out, results)
        rank0 = results[fmt]["ranks"][0]
        print(
            f"{fmt:>7}: rank 0 grew {rank0['growth_mib']:8.1f} MiB during the save "
            f"(state {results[fmt]['state_mib']:.1f} MiB; largest file "
            f"{results[fmt]['largest_file_share']:.0%} of the files)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
