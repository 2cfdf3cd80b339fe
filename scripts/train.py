"""Train the hybrid GDN/softmax-attention LM with context parallelism, on PyTorch or MindSpore.

    torchrun --nproc-per-node 2 scripts/train.py                   # the embedded default, CPU/gloo
    HP_PLATFORM=cuda torchrun --nproc-per-node 8 scripts/train.py --cp-size 4 --model-size base
    HP_PLATFORM=mindspore msrun --worker_num=2 --local_worker_num=2 --master_port=8118 \\
        --join=True --log_dir=msrun_log scripts/train.py --cp-mode p2p   # MindSpore, MCCL on CPU
    torchrun --nproc-per-node 2 --max-restarts 3 scripts/train.py --save ckpt --save-every 10
        # a restarted (or rerun) job resumes from the newest complete checkpoint under ckpt
    python scripts/train.py --plan --cp-size 4 --seq-len 65536 --model-size base   # memory per rank

Every option: ``python scripts/train.py --help`` and docs/training.md. Exit code 1 when
``--check-parity`` finds a loss difference above ``--parity-tol``; 2 for a user error (a bad
option, a missing or unreadable data file, model directory or checkpoint, a platform this
machine lacks), which rank 0 reports in one line, without a traceback (token ids outside the
model's vocabulary: every rank, ``train.py: rank R: error: ...``); 3 when a fault stopped the run
(``--max-bad-steps`` non-finite steps in a row, a checkpoint that could not be written under
``--on-save-error stop``, a rank that stopped answering for ``--timeout-s``), which every rank
reports in one line (``train.py: rank R: stopped: ...``); 128 + N after signal N (SIGTERM,
Ctrl-C), with one line naming the step reached and the last checkpoint. Under torchrun the shell
sees torchrun's code (1 when a worker failed) instead.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# Only framework-free modules here: the options and the memory plan are checked before torch is
# imported (a run over its memory budget is refused in the time Python takes to start).
from hyperpar_gdn.cli import USER_ERROR_GRACE_S, Stopped, launch_rank, print_line, run_script
from hyperpar_gdn.platform import platform_name
from hyperpar_gdn.platform.host_memory import keep_freed_host_memory
from hyperpar_gdn.train.command_line import parse_args
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.errors import FAULTS, USER_ERRORS, VocabularyError
from hyperpar_gdn.train.loop.faults import RankTimeoutError
from hyperpar_gdn.train.memory_check import MemoryBudgetError, check_memory, plan_lines

if TYPE_CHECKING:
    from hyperpar_gdn.train import Trainer, TrainResult
    from hyperpar_gdn.train.loop.callbacks import TrainCallback


class _Run:
    """The script's state that the stop line reports: the options and the trainer, once built."""

    config: TrainConfig | None = None
    trainer: Trainer | None = None

    def where(self) -> str:
        """``" at step N of M; ..."``: the step reached and the newest complete checkpoint."""
        if self.config is None:
            return " before training started"
        step = self.trainer.step if self.trainer is not None else 0
        text = f" at step {step} of {self.config.steps}"
        if self.config.save is None:
            return text + "; no checkpoints (--save DIR keeps them)"
        from hyperpar_gdn.train.checkpoints.directory import MANIFEST, list_checkpoints

        saved = [d for _, d in list_checkpoints(self.config.save) if (d / MANIFEST).is_file()]
        if not saved:
            return text + f"; no checkpoint under --save {self.config.save} yet"
        return text + f"; last checkpoint {saved[-1]} (the same command resumes from it)"


def main(argv: Sequence[str] | None = None, *, callbacks: Sequence[TrainCallback] = ()) -> int:
    """The script; ``callbacks``: hooks into the training loop (:mod:`hyperpar_gdn.train.loop.callbacks`;
    the tests' fault injection, ``tests/train/train_with_faults.py``)."""
    run = _Run()
    body = functools.partial(_every_rank, lambda: _run(argv, run, callbacks))
    # a refused memory plan is the same arithmetic on every rank: one line, on rank 0
    return run_script("train.py", body, user_errors=(*USER_ERRORS, MemoryBudgetError), where=run.where)


def _every_rank(body: Callable[[], int]) -> int:
    """``body()``, with the errors that each rank meets on its own reported by every rank."""
    try:
        return body()
    except FAULTS as err:  # each rank saw it in its own way: every rank says so
        print_line(f"train.py: rank {launch_rank()}: stopped: {err}")
        if isinstance(err, RankTimeoutError):  # a group with a silent peer hangs the interpreter's exit
            sys.stdout.flush()
            os._exit(3)
        _let_the_others_print()
        return 3
    except VocabularyError as err:  # a bad input that every rank checks alone
        print_line(f"train.py: rank {launch_rank()}: error: {err}")
        _let_the_others_print()
        return 2


def _let_the_others_print(grace_s: float = USER_ERROR_GRACE_S) -> None:
    """The launcher stops every worker once one exits: wait (at most ``grace_s``) so that
    the other ranks, which meet the same fault at about the same time, print their line too."""
    if int(os.environ.get("WORLD_SIZE", os.environ.get("MS_WORKER_NUM", "1")) or 1) > 1:
        try:
            time.sleep(grace_s)
        except (Stopped, KeyboardInterrupt):
            pass  # the launcher ends this rank once another exited: expected


def _run(argv: Sequence[str] | None, run: _Run, callbacks: Sequence[TrainCallback]) -> int:
    config = run.config = parse_args(argv)
    if config.plan:  # arithmetic only: nothing is built
        lines = plan_lines(config, platform=platform_name())
        if launch_rank() == 0:
            print("\n".join(lines), flush=True)
        return 0
    name = platform_name()
    if config.max_memory_gb is not None or name in ("cpu", "mindspore"):
        # every rank, before torch is imported and before any communication (the Trainer checks
        # again, and asks a device for its memory only after the platform was found usable)
        check_memory(config, platform=name)
    from hyperpar_gdn.train import Trainer

    # a file-size limit (ulimit -f) then fails the write (EFBIG, a save error) instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if name == "cpu":  # activations live in host memory: reuse it rather than page-fault
        keep_freed_host_memory()
    trainer_class: type[Trainer] = Trainer
    if name == "mindspore":
        from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

        trainer_class = MindSporeTrainer
    result: TrainResult | None = None
    try:
        run.trainer = trainer_class(config, callbacks=callbacks)
        result = run.trainer.train()
    finally:
        if run.trainer is not None:
            run.trainer.close()
    if config.export is not None and run.trainer.rank == 0:
        print(f"train.py: exported the model to {config.export} ({_size(Path(config.export))})", flush=True)
    return 0 if result is not None and result.parity_ok else 1


def _size(directory: Path) -> str:
    """The total size of the files under ``directory``, in MiB."""
    total = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return f"{total / 2**20:.1f} MiB in {sum(1 for f in directory.rglob('*') if f.is_file())} files"


if __name__ == "__main__":
    sys.exit(main())
