"""scripts/train.py with the fault-injection callbacks that ``HP_TRAIN_INJECT_NAN`` and
``HP_TRAIN_KILL_AT_STEP`` ask for (:mod:`hyperpar_gdn.train.loop.fault_injection`): the tests of the
trainer's fault handling launch this instead of the script, whose own run never injects faults.
Same options and exit codes as scripts/train.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from train import main  # noqa: E402 (scripts/train.py)

from hyperpar_gdn.cli import launch_rank  # noqa: E402
from hyperpar_gdn.train.loop.fault_injection import callbacks_from_environment  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(callbacks=callbacks_from_environment(launch_rank())))
