"""bench_published's table: the cost model against published device runs (fla's CP on H800
GPUs, an Ascend GDN layer at CP8, a serving report's prefill). The ratios are computed here by
running the model (nothing is timed); the bounds are what the model reaches, and the test fails
if a change to the model moves a prediction outside them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchkit import published
from benchkit.published import SETUPS, auto_rows, growth_rows, prediction_rows

ROOT = Path(__file__).resolve().parents[1]
WITHIN = 1.5  # the bound: predicted / published in [1/1.5, 1.5]


def test_training_runs_within_one_and_a_half() -> None:
    rows = [r for r in prediction_rows() if r["setup"] != "prefill with a state relay"]
    assert len(rows) == 6
    for r in rows:
        assert 1 / WITHIN <= r["ratio"] <= WITHIN, r


def test_weak_scaling_growth_within_one_and_a_half() -> None:
    rows = growth_rows()
    assert len(rows) == 4
    for r in rows:
        assert 1 / WITHIN <= r["ratio"] <= WITHIN, r
    by = {(r["mode"], r["tokens_per_rank"]): r["predicted_growth"] for r in rows}
    assert by["p2p", 8192] < by["ulysses", 8192] and by["p2p", 16384] < by["ulysses", 16384]


def test_auto_picks_the_fastest_published_mode() -> None:
    for r in auto_rows():
        assert r["auto_among_published"] == r["fastest_published"], r
        assert r["auto"] in ("p2p", "scan", "all_gather"), r  # a state mode, as the runs show


def test_prefill_gap_grows_with_cp() -> None:
    """The serving report's prefill: within 1.5x at cp 2, then too optimistic (its per-hop cost
    is not this library's relay, and its device is not given: docs/benchmarks.md)."""
    rows = {r["cp"]: r["ratio"] for r in prediction_rows() if r["setup"] == "prefill with a state relay"}
    assert 1 / WITHIN <= rows[2] <= WITHIN
    assert rows[8] < rows[4] < rows[2] and rows[8] > 0.4, rows


def test_without_the_head_term_ulysses_on_ascend_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The term this comparison added: without it (a kernel as fast on 4 heads per rank as on 32),
    ulysses at CP8 on Ascend is predicted faster than p2p and more than 1.5x under the report."""
    ascend = SETUPS[1]
    plain = replace(ascend, machine=replace(ascend.machine, saturating_heads=0.0))
    monkeypatch.setattr(published, "SETUPS", (SETUPS[0], plain, SETUPS[2]))
    rows = [r for r in published.prediction_rows() if r["setup"] == ascend.name and r["mode"] == "ulysses"]
    assert rows and all(r["ratio"] < 1 / WITHIN for r in rows), rows
    assert {r["auto"] for r in published.auto_rows() if r["setup"] == ascend.name} == {"ulysses"}


def test_script_writes_the_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "scripts/bench_published.py", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert (tmp_path / "published.json").stat().st_size > 1000
    assert "ratio" in done.stdout and "auto picks" in done.stdout
