"""The context-parallel ``Trainer`` with ``ep_size`` and a MoE model whose config sets
``output_router_logits`` (the router's load-balancing loss, coefficient 0.3), on real gloo ranks.

Oracle: transformers' own ``Trainer`` on one process over the same global batches (its model adds
``router_aux_loss_coef x load_balancing_loss_func`` over each batch, padding masked). Tiny
Qwen3.5 MoE, 8 experts, top-2, fp32, padded rows with an attention mask, gradient accumulation 2,
clipping acting: every logged loss and grad_norm, eval_loss and every final weight equal within
1e-5 at dp1 x cp2 x ep2, dp2 x cp2 x ep4, and with tensor parallelism at dp1 x cp2 x tp2 (the MoE
blocks split over tp), dp1 x cp2 x tp2 x ep2 and dp2 x cp2 x tp2 x ep4 (the expert-parallel
blocks whole over tp)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
from distributed_harness import run_ranks
from test_transformers_trainer import STEPS, TOL, _args, _examples, _padded, _rel
from tiny_models import tiny_config, tiny_model

transformers = pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from hyperpar_gdn.integrations.transformers.trainer import ContextParallelTrainer  # noqa: E402

COEF = 0.3


def _run(cp: dict | None, batch: int, out: str) -> dict[str, Any]:
    model = tiny_model(moe=True, num_experts=8).float()
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = COEF
    kwargs = dict(
        model=model,
        args=_args(out, batch),
        train_dataset=_examples(16, seed=1),
        eval_dataset=_examples(4, seed=2),
        data_collator=_padded(),
    )
    trainer = ContextParallelTrainer(**kwargs, **cp) if cp is not None else Trainer(**kwargs)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if cp is not None:
        from hyperpar_gdn.tensor_parallel import canonical_state_dict

        weights = canonical_state_dict(unwrapped)  # the experts gathered (collective)
    else:
        weights = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "weights": weights,
    }


def _worker(rank: int, world: int, cp: dict | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        # a global batch of 2 rows over the dp = world / (cp x tp) replicas
        batch = 2 if cp is None else 2 * cp["cp_size"] * cp.get("tp_size", 1) // world
        return _run(cp, batch, out)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return run_ranks(_worker, 1, None, timeout_s=300)[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "world,tp,ep",
    [(2, 1, 2), (4, 1, 4), (4, 2, 1), (4, 2, 2), (8, 2, 4)],
    ids=["dp1-cp2-ep2", "dp2-cp2-ep4", "dp1-cp2-tp2", "dp1-cp2-tp2-ep2", "dp2-cp2-tp2-ep4"],
)
def test_trainer_ep_with_router_loss_equals_one_process(
    reference: dict, world: int, tp: int, ep: int
) -> None:
    cp = {"cp_size": 2, "cp_mode": "p2p", "cp_layout": "head_tail", "tp_size": tp, "ep_size": ep}
    assert len(reference["loss"]) == STEPS and max(reference["grad_norm"]) > 0.05  # clipping acts
    for rank, got in enumerate(run_ranks(_worker, world, cp, timeout_s=600, pg_timeout_s=120)):
        for key in ("loss", "grad_norm", "eval_loss"):
            assert _rel(got[key], reference[key]) <= TOL, f"rank {rank} {key}: {got[key]} != {reference[key]}"
        for name, expected in reference["weights"].items():
            assert _rel(got["weights"][name], expected) <= TOL, f"rank {rank} weight {name}"


def test_ep_size_refused_in_one_line() -> None:
    from hyperpar_gdn.integrations.transformers.trainer_checks import check_trainer_setup

    model = tiny_model(moe=True, num_experts=8)
    common = dict(cp_mode="p2p", cp_layout=None, cp_chunk_size=64)
    with pytest.raises(ValueError, match="ep_size=3 does not divide the 4 data-parallel x CP ranks"):
        check_trainer_setup(model, None, world=4, cp_size=2, ep_size=3, **common)
    with pytest.raises(ValueError, match="ep_size=16: .*num_experts=8 is not divisible by ep=16"):
        check_trainer_setup(model, None, world=16, cp_size=2, ep_size=16, **common)
    with pytest.raises(ValueError, match=r"ep_size=8 does not divide the 4 .* / tp_size=2\)"):
        check_trainer_setup(model, None, world=8, cp_size=2, tp_size=2, ep_size=8, **common)
    setup = check_trainer_setup(model, None, world=4, cp_size=2, ep_size=4, **common)
    assert (setup.dp, setup.cp, setup.ep, setup.router_coef) == (2, 2, 4, 0.0)
    setup = check_trainer_setup(model, None, world=8, cp_size=2, tp_size=2, ep_size=4, **common)
    assert (setup.dp, setup.cp, setup.tp, setup.ep) == (2, 2, 2, 4)
    # expert-parallel MoE blocks stay whole over tp: their sizes need not divide it
    odd = tiny_config(moe=True, num_experts=8)
    odd.moe_intermediate_size = odd.shared_expert_intermediate_size = 25
    odd_model = transformers.Qwen3_5MoeForCausalLM(odd)
    with pytest.raises(ValueError, match="moe_intermediate_size=25 is not divisible by tp=2"):
        check_trainer_setup(odd_model, None, world=4, cp_size=2, tp_size=2, **common)
    assert check_trainer_setup(odd_model, None, world=4, cp_size=2, tp_size=2, ep_size=2, **common).ep == 2
