"""scripts/selfcheck.py checks every mode of the library's own list: on 4 gloo ranks under torchrun
every one-level and two-level mode passes and auto names its pick; where the world or the heads
do not allow a mode, its row says why it was skipped. With ``--tp 2`` (cp 2 x tp 2, the layer
split by heads; torch under torchrun, MindSpore under msrun) every one-level mode passes and the
two-level ones say why they are skipped; on torch a whole model made parallel by ``parallelize``
passes too; a ``--tp`` that does not fit the heads or the world is one error."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
from distributed_harness import ROOT, run_script

from hyperpar_gdn.planning.plan import MODES, TWO_LEVEL_MODES

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
    assert re.search(r"^model: parallelize\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", out, re.M), out
    total = len(MODES) + len(TWO_LEVEL_MODES) + 1  # and the whole model
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


@pytest.mark.timeout(300)
def test_four_ranks_at_tp2_check_every_mode_on_split_heads(tmp_path: Path) -> None:
    small = ["--seq-len", "64", "--hidden", "64", "--head-dim", "16"]  # 32 tokens per CP rank
    result = run_script("scripts/selfcheck.py", *small, "--tp", "2", ranks=4, cwd=tmp_path, timeout=280)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "ranks=4 (cp=2 x tp=2)" in out, out
    for mode in MODES:  # ulysses: the 8 value heads over tp x cp = 4
        assert re.search(rf"^{re.escape(mode)}\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", out, re.M), out
    for mode in TWO_LEVEL_MODES:
        assert re.search(
            rf"^{re.escape(mode)}\s+skipped: two levels need 4 or more ranks.*cp=2 \(tp=2\)", out, re.M
        )
    assert re.search(r"^auto\s+picks (\S+) \(its row above\)\s+ok$", out, re.M), out
    assert re.search(r"^model: parallelize \(tp 2\)\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", out, re.M), out
    n = len(MODES) + 1  # and the whole model
    assert out.rstrip().endswith(f"selfcheck: {n}/{n} ok, {len(TWO_LEVEL_MODES)} skipped"), out


def test_mindspore_at_tp2_under_msrun() -> None:
    """The same table from 4 MindSpore workers (MCCL), the GDN cell split by the MindSpore styles."""
    pytest.importorskip("mindspore")
    from msrun_harness import run_msrun

    args = ["--seq-len", "64", "--hidden", "32", "--head-dim", "16", "--tp", "2", "--timeout-s", "60"]
    outcome = run_msrun(ROOT / "scripts" / "selfcheck.py", 4, args, timeout_s=240)
    log = outcome.logs.get("worker_0.log", "")
    assert outcome.returncode == 0 and not outcome.timed_out, outcome.describe()
    assert "platform=mindspore ranks=4 (cp=2 x tp=2) T=64" in log, log
    for mode in MODES:
        assert re.search(rf"^{re.escape(mode)}\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", log, re.M), log
    assert f"selfcheck: {len(MODES)}/{len(MODES)} ok, {len(TWO_LEVEL_MODES)} skipped" in log, log


def test_tp_that_does_not_fit_is_one_error() -> None:
    import argparse

    script = _script()
    args = argparse.Namespace(tp=2, k_heads=4, v_heads=8, seq_len=64)
    assert script.check_tp(args) == 2
    assert script.world_error(args, 4, 2) is None
    assert "--tp 2 must divide the 3 launched ranks" in script.world_error(args, 3, 2)
    assert "--seq-len 64 must be divisible by the cp=3 ranks (world 6 / tp 2)" in script.world_error(
        args, 6, 2
    )
    with pytest.raises(ValueError, match="--k-heads 3 must be divisible by tp"):
        script.check_tp(argparse.Namespace(tp=2, k_heads=3, v_heads=6, seq_len=64))


@pytest.mark.timeout(300)
def test_two_ranks_check_a_moe_block_at_ep2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    small = ["--seq-len", "64", "--hidden", "32", "--head-dim", "16", "--ep", "2"]
    result = run_script("scripts/selfcheck.py", *small, ranks=2, cwd=tmp_path, timeout=280)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"^MoE block, ep 2\s+\S+ \([\w.]+\)\s+[\d.]+s\s+ok$", out, re.M), out
    script = _script()
    with pytest.raises(ValueError, match="--ep 3 splits the 64 tokens"):
        script.check_ep(argparse.Namespace(ep=3, seq_len=64), "cpu")
    with pytest.raises(ValueError, match="expert parallelism runs on torch"):
        script.check_ep(argparse.Namespace(ep=2, seq_len=64), "mindspore")
