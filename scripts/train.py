"""Train the hybrid GDN/softmax-attention LM with context parallelism, on PyTorch or MindSpore.

    torchrun --nproc-per-node 2 scripts/train.py                   # the embedded default, CPU/gloo
    HP_PLATFORM=cuda torchrun --nproc-per-node 8 scripts/train.py --cp-size 4 --model-size base
    HP_PLATFORM=mindspore msrun --worker_num=2 --local_worker_num=2 --master_port=8118 \\
        --join=True --log_dir=msrun_log scripts/train.py --cp-mode p2p   # MindSpore, MCCL on CPU
    torchrun --nproc-per-node 2 --max-restarts 3 scripts/train.py --save ckpt --save-every 10
        # a restarted (or rerun) job resumes from the newest complete checkpoint under ckpt

Every option: ``python scripts/train.py --help`` and docs/training.md. Exit code 1 when
``--check-parity`` finds a loss difference above ``--parity-tol``; 2 for a user error (a bad
option, a missing or unreadable data file, model directory or checkpoint), which rank 0 reports
in one line, without a traceback; 3 when a fault stopped the run (``--max-bad-steps``
non-finite steps in a row, a checkpoint that could not be written under ``--on-save-error stop``, a
rank that stopped answering for ``--timeout-s``), which every rank reports in one line.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from hyperpar_gdn.platform import platform_name
from hyperpar_gdn.platform.host_memory import keep_freed_host_memory
from hyperpar_gdn.train import FAULTS, USER_ERRORS, RankTimeoutError, Trainer, TrainResult, parse_args
from hyperpar_gdn.train.data import VocabularyError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except FAULTS as err:  # each rank saw it in its own way: every rank says so
        print(f"train.py: rank {_rank()}: stopped: {err}", file=sys.stderr, flush=True)
        if isinstance(err, RankTimeoutError):  # a group with a silent peer hangs the interpreter's exit
            sys.stdout.flush()
            os._exit(3)
        return 3
    except VocabularyError as err:  # a bad input that every rank checks alone
        print(f"train.py: rank {_rank()}: error: {err}", file=sys.stderr, flush=True)
        return 2
    except USER_ERRORS as err:
        if _rank() == "0":
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("RANK_ID", "0"))  # torchrun / msrun


def _run(argv: Sequence[str] | None) -> int:
    config = parse_args(argv)
    # a file-size limit (ulimit -f) then fails the write (EFBIG, a save error) instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if platform_name() == "cpu":  # activations live in host memory: reuse it rather than page-fault
        keep_freed_host_memory()
    trainer_class: type[Trainer] = Trainer
    if platform_name() == "mindspore":
        from hyperpar_gdn.train.mindspore_loop import MindSporeTrainer

        trainer_class = MindSporeTrainer
    trainer = None
    result: TrainResult | None = None
    try:
        trainer = trainer_class(config)
        result = trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    return 0 if result is not None and result.parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
