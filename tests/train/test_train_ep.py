"""``--ep`` and ``--router-aux-loss-coef`` in the trainer (real gloo ranks, a tiny transformers
Qwen3.5 MoE directory made offline: 8 experts, top-2).

10 fp32 steps at (dp 1, cp 2, ep 2), (dp 2, cp 2, ep 2) and (dp 2, cp 2, ep 4, with ``--ac``), the
load-balancing loss on: every step's loss equals the ``--check-parity`` copy's, which rank 0 trains
alone on the whole batch with transformers' loss (cross-entropy plus the coefficient times
``load_balancing_loss_func`` over the whole batch), within 1e-5; the gradient clipping acts, so the
norm over the experts' shards and the whole tensors is checked too. Wrong set-ups are one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from distributed_harness import run_ranks

from hyperpar_gdn.train import TrainConfig, Trainer

pytest.importorskip("transformers")

TOL = 1e-5
BASE = {"seq_len": 32, "batch_size": 4, "cp_mode": "p2p", "lr": 3e-3, "seed": 1, "steps": 10}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35

    sizes = {"num_experts": 8, "router_aux_loss_coef": 0.2, "output_router_logits": True}
    return write_tiny_qwen35(tmp_path_factory.mktemp("model") / "moe", moe=True, sizes=sizes)


def _worker(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    trainer = Trainer(TrainConfig(**BASE, **options, check_parity=True))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    out: dict[str, Any] = {"losses": result.losses, "coef": trainer.backend.router_coef}
    if rank == 0:
        out["reference"] = [r.reference_loss for r in result.records]
    return out


@pytest.mark.parametrize(
    "world,options",
    [
        (2, {"ep": 2}),
        (4, {"ep": 2, "cp_size": 2, "grad_clip": 0.05}),
        (4, {"ep": 4, "cp_size": 2, "ac": True}),
    ],
    ids=["dp1-cp2-ep2", "dp2-cp2-ep2", "dp2-cp2-ep4-ac"],
)
def test_ep_training_losses_equal_one_process(model_dir: Path, world: int, options: dict[str, Any]) -> None:
    results = run_ranks(_worker, world, {"model_dir": str(model_dir), **options}, timeout_s=600)
    reference = results[0]["reference"]
    assert len(reference) == BASE["steps"] and reference[-1] < reference[0]
    for rank, result in enumerate(results):
        assert result["coef"] == 0.2  # the config's output_router_logits and coefficient
        for step, (got, want) in enumerate(zip(result["losses"], reference, strict=True)):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank} step {step + 1}: {got} vs {want}"


def test_ep_options_refused_in_one_line(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--ep 2 acts on a MoE model"):
        TrainConfig(ep=2)
    with pytest.raises(NotImplementedError, match="--ep 2 with --tp"):
        TrainConfig(ep=2, tp=2, model_dir=str(model_dir))
    with pytest.raises(ValueError, match=r"--ep 4 must divide the data-parallel x CP ranks dp x cp = 1 x 2"):
        TrainConfig(ep=4, model_dir=str(model_dir), seq_len=32).mesh_shape(2)
