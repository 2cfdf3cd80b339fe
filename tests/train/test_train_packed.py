"""Training on packed documents (real gloo ranks): with document boundaries (the default) every
CP mode follows the run without CP step by step; the boundaries change the run (they are not
ignored), and --no-doc-boundaries trains on plain windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed_harness import run_ranks
from test_train import _train  # tests/train is on sys.path under pytest

from hyperpar_gdn.corpus import BUILTIN_CORPUS

STEPS = 8
PARITY_TOL = 1e-4  # fp32, per step


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in corpus's paragraphs as JSONL documents of mixed lengths (15 to 500 bytes)."""
    paragraphs = [p.replace("\n", " ") for p in BUILTIN_CORPUS.split("\n\n")]
    pieces = [piece for p in paragraphs for piece in (p[:15], p[15:]) if piece]
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": piece}) + "\n" for piece in pieces))
    return str(path)


@pytest.mark.parametrize("mode", ["ulysses", "p2p", "all_gather"])
def test_packed_cp_matches_the_run_without_cp(mode: str, documents: str) -> None:
    options = {"data": documents, "seq_len": 64, "batch_size": 4, "steps": STEPS, "cp_mode": mode}
    rank0, _ = run_ranks(_train, 2, {**options, "check_parity": True}, timeout_s=150)
    diffs = [abs(a - b) for a, b in zip(rank0["losses"], rank0["reference"], strict=True)]
    assert max(diffs) <= PARITY_TOL, diffs


def test_boundaries_are_used(documents: str, tmp_path: Path) -> None:
    options = {"data": documents, "seq_len": 64, "batch_size": 4, "steps": 3, "cp_mode": "p2p"}
    packed = run_ranks(_train, 2, options, timeout_s=120)[0]["losses"]
    plain = run_ranks(_train, 2, {**options, "doc_boundaries": False}, timeout_s=120)[0]["losses"]
    assert abs(packed[0] - plain[0]) > 1e-3, (packed, plain)  # restarts and unlearnt labels show
