"""Resuming the context-parallel ``Trainer`` under ``tp_size`` and ``ep_size`` from its
checkpoint (every rank's shards and optimizer state), on real gloo ranks.

Oracle: the same run uninterrupted. Tiny Qwen3.5 MoE, 8 experts, fp32, AdamW (its moments are
per-rank shards), gradient accumulation 2, clipping acting, 4 steps with a checkpoint at step 2:
the run resumed from it logs the same losses, grad_norm and learning rates at steps 3 and 4 and
ends with the same weights, at dp1 x cp2 x tp2 and dp1 x cp2 x ep2. A resume at other sizes is
refused on every rank, naming both. With ``load_best_model_at_end`` (the best checkpoint an earlier
one) the model ends with the weights transformers loads from that checkpoint's directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from test_transformers_trainer import TOL, _args, _examples, _padded, _rel
from tiny_models import tiny_model

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from hyperpar_gdn.integrations.transformers.trainer import ContextParallelTrainer  # noqa: E402

STEPS, SAVE_AT = 4, 2
# eval_loss at steps 2 and 4; the higher one is "best" here, so that the best checkpoint is not the last
BEST = dict(
    eval_strategy="steps",
    eval_steps=SAVE_AT,
    load_best_model_at_end=True,
    metric_for_best_model="loss",
    greater_is_better=True,
)


def _run(cp: dict, out: str, resume: str | None = None, **overrides: Any) -> Any:
    args = _args(
        out, 2, optim="adamw_torch", max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT, **overrides
    )
    model = tiny_model(moe=True, num_experts=8).float()
    trainer = ContextParallelTrainer(
        model=model,
        args=args,
        train_dataset=_examples(16, seed=1),
        eval_dataset=_examples(4, seed=2),
        data_collator=_padded(),
        **cp,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _summary(trainer: Any) -> dict[str, Any]:
    from hyperpar_gdn.tensor_parallel import canonical_state_dict

    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "step": [h["step"] for h in logs],
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "weights": canonical_state_dict(trainer.accelerator.unwrap_model(trainer.model)),  # collective
    }


def _worker(rank: int, world: int, cp: dict, work_dir: str) -> dict[str, Any]:
    out = str(Path(work_dir) / "out")
    whole = _summary(_run(cp, out))
    checkpoint = str(Path(out) / f"checkpoint-{SAVE_AT}")
    resumed = _summary(_run(cp, out, resume=checkpoint))
    # this rank's files load data-only and hold the optimizer's moments
    optim = torch.load(Path(checkpoint) / f"rank{rank}-of-{world}-optimizer.pt", weights_only=True)
    moments = sum(key == "exp_avg" for state in optim["state"].values() for key in state)
    other = {**cp, "tp_size": 1, "ep_size": 1}  # the same ranks without tp and ep
    try:  # refused on every rank before any communication
        _run(other, str(Path(work_dir) / "other"), resume=checkpoint)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    # load_best_model_at_end: the best checkpoint's shards, as transformers loads its whole weights
    best = _run(cp, str(Path(work_dir) / "best"), **BEST)
    from hyperpar_gdn.tensor_parallel import canonical_state_dict

    loaded = canonical_state_dict(best.accelerator.unwrap_model(best.model))  # collective
    saved = AutoModelForCausalLM.from_pretrained(best.state.best_model_checkpoint).state_dict()
    best_diff = max(_rel(loaded[name], value) for name, value in saved.items())
    return {
        "whole": whole,
        "resumed": resumed,
        "moments": moments,
        "refusal": refusal,
        "best": (Path(best.state.best_model_checkpoint).name, best_diff),
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "world,tp,ep,saved",
    [(4, 2, 1, "dp1 x cp2 x tp2 x ep1"), (2, 1, 2, "dp1 x cp2 x tp1 x ep2")],
    ids=["dp1-cp2-tp2", "dp1-cp2-ep2"],
)
def test_resume_equals_the_uninterrupted_run(
    tmp_path: Path, world: int, tp: int, ep: int, saved: str
) -> None:
    cp = {"cp_size": 2, "cp_mode": "p2p", "cp_layout": "head_tail", "tp_size": tp, "ep_size": ep}
    for rank, got in enumerate(run_ranks(_worker, world, cp, str(tmp_path), timeout_s=600, pg_timeout_s=120)):
        whole, resumed = got["whole"], got["resumed"]
        assert whole["step"] == resumed["step"] == list(range(1, STEPS + 1)), (whole["step"], resumed["step"])
        assert max(whole["grad_norm"]) > 0.05, "clipping must act: grad_norm above max_grad_norm"
        after = slice(SAVE_AT, STEPS)  # the steps the resumed run trained
        for key in ("loss", "grad_norm", "lr"):
            diff = _rel(resumed[key][after], whole[key][after])
            print(f"rank {rank} {key} steps {SAVE_AT + 1}..{STEPS}: resumed - uninterrupted rel {diff:.3g}")
            assert diff <= TOL, f"rank {rank} {key}: {resumed[key]} != {whole[key]}"
        weights = {name: _rel(resumed["weights"][name], w) for name, w in whole["weights"].items()}
        print(f"rank {rank} final weights: largest rel difference {max(weights.values()):.3g}")
        for name, diff in weights.items():
            assert diff <= TOL, f"rank {rank} weight {name}: rel {diff}"
        assert got["moments"] > 0, f"rank {rank}: no AdamW moments in its optimizer file"
        other = f"dp{world // 2} x cp2 x tp1 x ep1"
        refusal = got["refusal"]
        assert f"was saved at {saved} ({world} processes) and this run is {other}" in refusal, refusal
        print(f"rank {rank} load_best_model_at_end: {got['best']}")
        assert got["best"] == (f"checkpoint-{SAVE_AT}", 0.0), f"rank {rank}: best model {got['best']}"


def test_saved_sizes_checked(tmp_path: Path) -> None:
    from hyperpar_gdn.integrations.transformers.trainer_checkpoints import check_saved_sizes

    sizes = {"world": 4, "dp": 1, "cp": 2, "tp": 2, "ep": 1}
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        check_saved_sizes(str(tmp_path / "absent"), sizes, sharded=True)
    check_saved_sizes(str(tmp_path), {**sizes, "tp": 1}, sharded=False)  # transformers' own checkpoint
    with pytest.raises(ValueError, match=r"holds no per-rank state .* this run is dp1 x cp2 x tp2 x ep1"):
        check_saved_sizes(str(tmp_path), sizes, sharded=True)
    (tmp_path / "parallel_sizes.json").write_text('{"world": 4, "dp": 1, "cp": 2, "tp": 2, "ep": 1}')
    check_saved_sizes(str(tmp_path), sizes, sharded=True)
    with pytest.raises(
        ValueError, match=r"saved at dp1 x cp2 x tp2 x ep1 \(4 processes\) and this run is dp1 x cp4"
    ):
        check_saved_sizes(str(tmp_path), {**sizes, "cp": 4, "tp": 1}, sharded=False)
