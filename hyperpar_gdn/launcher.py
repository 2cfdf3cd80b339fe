"""``hyperpar-train``: check ``scripts/train.py``'s options, then start its ranks under torchrun.

    hyperpar-train --nproc-per-node 2 --cp-mode p2p --seq-len 256

is ``torchrun --nproc-per-node 2 scripts/train.py --cp-mode p2p --seq-len 256`` with two
differences a user sees after a mistake:

- the options, the world size they imply and the memory plan are checked first, in this
  process: a mistake there is one line (``train.py: error: ...``), exit code 2, and no rank starts;
- a run whose ranks fail ends with one line, the first failed rank's (its error, or its exit
  code), instead of torchrun's failure report: torchrun runs in this process with its own log
  quiet, and a user error on rank 0 reaches this process through a file rather than the console.

Other torchrun options (``--nnodes``, rendezvous, ``--max-restarts``): run torchrun itself.
``scripts/train.py`` comes from the source checkout this package is installed from (``pip
install -e``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hyperpar_gdn.cli import ERROR_LINE_FILE, Parser, UsageError, print_line
from hyperpar_gdn.train.errors import USER_ERRORS
from hyperpar_gdn.train.memory_check import MemoryBudgetError

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def _check(nproc: int, train_argv: list[str]) -> None:
    """What every rank would check before communicating, for ``nproc`` ranks on this host."""
    from hyperpar_gdn.platform import platform_name
    from hyperpar_gdn.train.command_line import parse_args
    from hyperpar_gdn.train.memory_check import check_memory

    config = parse_args(train_argv)
    if config.plan:
        return  # rank 0 prints the plan
    previous = {name: os.environ.get(name) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    try:
        config.mesh_shape(nproc)
        name = platform_name()
        if config.max_memory_gb is not None or name == "cpu":
            check_memory(config, platform=name)
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _torchrun(nproc: int, train_argv: list[str], error_file: Path) -> str | None:
    """Run the ranks under torchrun in this process -> None, or the one line that says why they failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)  # torchrun's own notices (SIGTERM sent, a rank failed)
    args = get_args_parser().parse_args(["--nproc-per-node", str(nproc), str(SCRIPT), *train_argv])
    os.environ[ERROR_LINE_FILE] = str(error_file)
    try:
        run(args)
    except ChildFailedError as failed:
        if error_file.is_file() and error_file.read_text().strip():
            return error_file.read_text().strip()
        rank, failure = failed.get_first_failure()
        return f"hyperpar-train: rank {rank} failed with exit code {failure.exitcode} (its lines are above)"
    finally:
        os.environ.pop(ERROR_LINE_FILE, None)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code: 0; 2 after a mistake found before the ranks start; 1 when a rank failed."""
    parser = Parser(prog="hyperpar-train", description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    parser.add_argument("-h", "--help", action="store_true")
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        own, train_argv = parser.parse_known_args(words)
        if own.help:
            print(__doc__.strip())
            print("\nscripts/train.py's options: python scripts/train.py --help")
            return 0
        if own.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1; got {own.nproc_per_node}")
        if not SCRIPT.is_file():
            raise FileNotFoundError(
                f"{SCRIPT}: no such file; hyperpar-train runs the training script of a source checkout "
                "(pip install -e)"
            )
        _check(own.nproc_per_node, train_argv)
    except (*USER_ERRORS, MemoryBudgetError) as err:
        print_line(f"train.py: error: {err}")
        return 2
    with tempfile.TemporaryDirectory(prefix="hyperpar-train-") as scratch:
        why = _torchrun(own.nproc_per_node, train_argv, Path(scratch) / "error_line")
    if why is not None:
        print_line(why)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
