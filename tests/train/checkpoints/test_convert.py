"""``python -m hyperpar_gdn.train.checkpoints.convert``: a sharded checkpoint of a ``--model`` run (2 gloo
ranks, --fsdp) becomes, on one host, a transformers directory with the weights that the run's own
``--export`` wrote, and a whole checkpoint with the same state; ``--export`` still works in a run
resumed from a sharded checkpoint. A built-in model's checkpoint --to transformers is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35
from hyperpar_gdn.train import TrainConfig, Trainer, load_checkpoint
from hyperpar_gdn.train.checkpoints.directory import FORMAT, read_manifest
from hyperpar_gdn.train.checkpoints.convert import convert, main

transformers = pytest.importorskip("transformers")

STEPS = 4


def _train(root: Path, model_dir: Path, name: str, **options: Any) -> list[float]:
    config = {
        "model_dir": str(model_dir),
        "cp_mode": "p2p",
        "seq_len": 32,
        "batch_size": 2,
        "steps": STEPS,
        "lr": 3e-3,
        "fsdp": True,
        "save": str(root / name),
        "save_every": 2,
        "export": str(root / f"{name}-export"),
        **options,
    }
    trainer = Trainer(TrainConfig(**config))
    try:
        return trainer.train().losses
    finally:
        trainer.close()


def _runs(rank: int, world: int, root: Path, model_dir: Path) -> dict[str, list[float]]:
    straight = _train(root, model_dir, "straight")
    resumed = _train(root, model_dir, "resumed", resume=str(root / "straight" / "step-2"))
    return {"straight": straight, "resumed": resumed}


def _logits(directory: Path, probe: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=probe, use_cache=False).logits


@pytest.mark.timeout(400)
def test_a_sharded_checkpoint_converts_on_one_host(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model_dir = write_tiny_qwen35(tmp_path / "tiny")
    out = run_ranks(_runs, 2, tmp_path, model_dir, timeout_s=300)[0]
    assert out["resumed"] == out["straight"][2:]
    checkpoint = tmp_path / "straight" / f"step-{STEPS}"
    assert "shards" in read_manifest(checkpoint)

    converted = convert(tmp_path / "straight", tmp_path / "converted", to="transformers")
    assert converted == tmp_path / "converted"
    probe = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    exported = _logits(tmp_path / "straight-export", probe)
    assert torch.equal(_logits(converted, probe), exported)  # the very weights --export wrote
    assert (_logits(model_dir, probe) - exported).abs().max() > 1e-2  # trained, not the initial ones
    # --export in the run resumed from the sharded step-2: the same trained model
    torch.testing.assert_close(_logits(tmp_path / "resumed-export", probe), exported, rtol=0, atol=1e-5)

    assert main([str(checkpoint), str(tmp_path / "whole"), "--to", "whole"]) == 0
    assert f"wrote {tmp_path / 'whole' / f'step-{STEPS}'}" in capsys.readouterr().out
    assert read_manifest(tmp_path / "whole" / f"step-{STEPS}")["format"] == FORMAT
    _, sharded, _ = load_checkpoint(checkpoint)
    _, whole, meta = load_checkpoint(tmp_path / "whole" / f"step-{STEPS}")
    assert meta["config"]["model_dir"] == str(model_dir)
    assert sharded["model"].keys() == whole["model"].keys()
    assert all(torch.equal(whole["model"][k], v) for k, v in sharded["model"].items())
    assert (
        whole["data"] == sharded["data"]
        and whole["optimizer"]["param_groups"] == sharded["optimizer"]["param_groups"]
    )


def _builtin(rank: int, world: int, root: Path) -> None:
    trainer = Trainer(TrainConfig(seq_len=32, batch_size=2, steps=1, cp_size=1, save=str(root)))
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.mark.timeout(120)
def test_a_builtin_model_has_no_transformers_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_ranks(_builtin, 1, tmp_path / "ckpt", timeout_s=60)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "transformers"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"convert: error: checkpoint {tmp_path / 'ckpt' / 'step-1'} is of the built-in model"
    )
    assert "\n" not in err and not (tmp_path / "out").exists()
