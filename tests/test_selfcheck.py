"""scripts/selfcheck.py checks every mode of the library's own list: on 4 gloo ranks under torchrun
every one-level and two-level mode passes and auto names its pick; where the world or the heads
do not allow a mode, its row says why it was skipped."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
from distributed_harness import ROOT, run_script

from hyperpar_gdn.distributed.plan import MODES, TWO_LEVEL_MODES

SMALL = ["--seq-len", "128"]  # the default layer; 32 tokens per rank


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("selfcheck_script", ROOT / "scripts" / "selfcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_four_ranks_check_every_mode_two_level_included(tmp_path: Path) -> None:
    result = run_script("scripts/selfcheck.py", *SMALL, ranks=4, cwd=tmp_path, timeout=280)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for mode in MODES:
        assert re.search(rf"^{re.escape(mode)}\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", out, re.M), out
    for mode in TWO_LEVEL_MODES:  # 4 ranks: two groups of 2, ulysses inside each
        assert re.search(rf"^{re.escape(mode)} \(inner 2\)\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", out, re.M), out
    picked = re.search(r"^auto\s+picks (\S+) \(its row above\)\s+ok$", out, re.M)
    assert picked and picked[1] in MODES, out
    total = len(MODES) + len(TWO_LEVEL_MODES)
    assert out.rstrip().endswith(f"selfcheck: {total}/{total} ok, 0 skipped"), out


def test_skipped_modes_say_why() -> None:
    inner_size_for = _script().inner_size_for
    assert inner_size_for(4, 4, None) == (2, "")
    assert inner_size_for(8, 8, None) == (2, "")
    none, why = inner_size_for(2, 4, None)
    assert none is None and "two levels need 4 or more ranks" in why and "2 launched" in why
    none, why = inner_size_for(4, 3, None)  # 3 value heads: no inner group of 2 splits them
    assert none is None and "3 value heads" in why
    none, why = inner_size_for(8, 8, 3)
    assert none is None and "--inner-size 3" in why
