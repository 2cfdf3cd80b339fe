"""Train the hybrid GDN/softmax-attention LM with context parallelism.

    torchrun --nproc-per-node 2 scripts/train.py                   # the embedded default, CPU/gloo
    HP_PLATFORM=cuda torchrun --nproc-per-node 8 scripts/train.py --cp-size 4 --model-size base

Every option: ``python scripts/train.py --help`` and docs/training.md. Exit code 1 when
``--check-parity`` finds a loss difference above ``--parity-tol``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hyperpar_gdn.train import Trainer, parse_args


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    trainer = None
    try:
        trainer = Trainer(config)
        result = trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    return 0 if result.parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
