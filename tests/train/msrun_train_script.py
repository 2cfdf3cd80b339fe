"""scripts/train.py as an msrun worker for tests: the harness's watchdog (a worker exits at the
job's deadline), then the script's own ``main`` with the command line msrun passed; the worker
reports its exit code through the harness."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for msrun_harness

from msrun_harness import start_watchdog, write_result  # noqa: E402

if __name__ == "__main__":
    start_watchdog()
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "train.py"))
    code = script["main"](sys.argv[1:])
    write_result(int(os.environ["RANK_ID"]), {"exit": code})
    sys.exit(code)
