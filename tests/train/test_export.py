"""``--export`` writes the trained model as a transformers directory (real gloo ranks): under
``--fsdp`` every rank takes part in gathering the weights, the directory loads in transformers
with the trained weights, and a failed export leaves no directory behind. A rank-0 failure at
the end of a run (export, metrics) stops every rank instead of leaving them waiting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch_ranks, run_ranks

from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35
from hyperpar_gdn.train import TrainConfig, Trainer

transformers = pytest.importorskip("transformers")

STEPS = 4
FSDP_TOL = 1e-5  # fp32: FSDP sums the same gradient shares in another order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35(tmp_path_factory.mktemp("model") / "tiny")


def _options(model_dir: Path, export: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model_dir": str(model_dir),
        "export": str(export),
        "cp_mode": "p2p",
        "seq_len": 32,
        "batch_size": 2,
        "steps": STEPS,
        "lr": 3e-3,
        **extra,
    }


def _train(rank: int, world: int, options: dict[str, Any], sabotage: bool = False) -> list[float]:
    trainer = Trainer(TrainConfig(**options))
    try:
        if sabotage and rank == 0:  # the model's files are written, then the tokenizer's fail

            def fail(*args: Any, **kwargs: Any) -> None:
                raise OSError("disk full (injected)")

            trainer.tokenizer.save_pretrained = fail
        return trainer.train().losses
    finally:
        trainer.close()


def _logits(directory: Path, probe: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=probe, use_cache=False).logits


@pytest.mark.parametrize("extra", [{"fsdp": True}, {"fsdp": True, "ac": True}], ids=["fsdp", "fsdp-ac"])
def test_fsdp_export_loads_with_trained_weights(model_dir: Path, tmp_path: Path, extra: dict) -> None:
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    plain_losses = run_ranks(_train, 2, _options(model_dir, plain), timeout_s=180)[0]
    sharded_losses = run_ranks(_train, 2, _options(model_dir, sharded, **extra), timeout_s=180)[0]
    assert max(abs(a - b) for a, b in zip(plain_losses, sharded_losses, strict=True)) <= FSDP_TOL
    probe = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = _logits(plain, probe), _logits(sharded, probe)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (_logits(model_dir, probe) - got).abs().max() > 1e-2  # the trained weights, not the initial ones
    config = (sharded / "config.json").read_text()
    assert '"Qwen3_5ForCausalLM"' in config and "FSDP" not in config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "sharded"]  # no temporary left


def test_failed_export_leaves_no_directory(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    outcome = launch_ranks(_train, 2, _options(model_dir, out, fsdp=True), True, timeout_s=180)
    assert not outcome.dead and not outcome.results, outcome
    assert "disk full (injected)" in outcome.errors[0]
    assert (
        "SaveError" in outcome.errors[1]
        and f"rank 0 could not export the model to {out}" in outcome.errors[1]
    )
    assert list(tmp_path.iterdir()) == []
    # an existing directory survives a failed export unchanged
    out.mkdir()
    (out / "keep").write_text("x")
    outcome = launch_ranks(_train, 2, _options(model_dir, out), True, timeout_s=180)
    assert len(outcome.errors) == 2 and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_failed_metrics_write_stops_every_rank(tmp_path: Path) -> None:
    options = {"steps": 1, "seq_len": 32, "batch_size": 2, "metrics_json": str(tmp_path / "no" / "m.json")}
    (tmp_path / "no").write_text("a file, not a directory")
    outcome = launch_ranks(_train, 2, options, timeout_s=120)
    assert not outcome.dead and not outcome.timed_out and not outcome.results, outcome
    assert "SaveError" in outcome.errors[1] and "rank 0 could not write --metrics-json" in outcome.errors[1]
