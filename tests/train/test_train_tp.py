"""``--tp`` in the trainer (real gloo ranks, a tiny transformers Qwen3.5 directory made offline):

- dp 2 x cp 2 x tp 2 (8 ranks) with ``--fsdp --ac``: 10 steps with the losses of one process (the
  ``--check-parity`` copy, which rank 0 trains alone on the whole batch; the gradient clipping is
  active, so the global norm over TP shards, FSDP shards and whole tensors is checked too); the
  ``--export`` directory loads in transformers with the one-process model's weights and logits;
  wrong set-ups (a world the mesh does not fill, heads not divisible by ``--tp``) are one line on
  every rank.
- checkpoints: a sharded checkpoint saved at (dp 1, cp 2, tp 2) (a run with the losses of one
  process) resumes at (dp 1, cp 4, tp 1) and at (dp 2, cp 1, tp 2) with the uninterrupted run's
  losses, and back (saved at tp 1, resumed at tp 2 with ``--fsdp``); the converter turns it into the single-device layout (a tp 2 run resumes from that, its
  parity copy too); a whole checkpoint and an export written by tp 2 runs hold the single-device
  layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.train import TrainConfig, Trainer

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # relative, per step (fp32)
BASE = {"seq_len": 32, "batch_size": 4, "cp_mode": "p2p", "lr": 3e-3, "seed": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense Qwen3.5 directory (2 GDN q/k heads, 4 value heads, 4 attention heads over 2
    K/V heads): it splits at tp 2, not at tp 4."""
    from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35

    return write_tiny_qwen35(tmp_path_factory.mktemp("model") / "dense")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _run(options: dict[str, Any]) -> tuple[Trainer, Any]:
    trainer = Trainer(TrainConfig(**BASE, **options))
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


def _error(options: dict[str, Any]) -> str:
    try:
        _run(options)
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _fsdp_worker(rank: int, world: int, model: str, export: str, probe: torch.Tensor) -> dict[str, Any]:
    errors = {
        "world": _error({"model_dir": model, "tp": 2, "cp_size": 3}),
        "heads": _error({"model_dir": model, "tp": 4, "cp_size": 2}),
    }
    options = {"model_dir": model, "tp": 2, "cp_size": 2, "fsdp": True, "ac": True, "steps": 10}
    trainer, result = _run({**options, "check_parity": True, "export": export})
    out: dict[str, Any] = {"errors": errors, "losses": result.losses}
    if rank == 0:  # the one-process copy: its losses, weights and logits
        reference = trainer.backend.reference.eval()
        out["reference"] = [r.reference_loss for r in result.records]
        out["weights"] = {n: p.detach().clone() for n, p in reference.named_parameters()}
        with torch.no_grad():
            out["logits"] = reference(input_ids=probe, use_cache=False).logits
    return out


def test_dp2_cp2_tp2_fsdp_equals_one_process(model_dir: Path, tmp_path: Path) -> None:
    export = tmp_path / "export"
    probe = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    results = run_ranks(_fsdp_worker, 8, str(model_dir), str(export), probe, timeout_s=400)
    rank0 = results[0]
    losses, reference = rank0["losses"], rank0["reference"]
    assert all(r["losses"] == losses for r in results)  # every rank reports the global loss
    assert max(losses[-3:]) < losses[0] - 0.3, losses  # it trains
    worst = max(_rel(a, b) for a, b in zip(losses, reference, strict=True))
    assert worst <= TOL, (
        f"dp 2 x cp 2 x tp 2 --fsdp: losses differ from one process by {worst:.2e} (relative)"
    )

    # the export: the single-device layout, the one-process model's weights and logits
    exported = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    weights = dict(exported.named_parameters())
    # rows out of place would differ by ~1; the gates' weights (in_proj_a, A_log, dt_bias) get
    # gradients near zero, whose rounding Adam turns into full-size steps: ~1e-2 after 10 steps
    for name, expected in rank0["weights"].items():
        err = ((weights[name] - expected).abs().max() / expected.abs().max()).item()
        assert err <= 5e-2, f"exported {name} differs from the one-process model's by {err:.1e}"
    with torch.no_grad():
        logits = exported(input_ids=probe, use_cache=False).logits
    err = ((logits - rank0["logits"]).abs().max() / rank0["logits"].abs().max()).item()
    assert err <= 1e-4, f"the exported model's logits differ from the one-process model's by {err:.1e}"

    # wrong set-ups: the same one line on every rank
    for case, words in {
        "world": "8 ranks (torchrun --nproc-per-node x --nnodes, or msrun --worker_num) cannot be split "
        "into CP groups of --cp-size 3: --cp-size x --tp = 3 x 2 must divide 8",
        "heads": f"--tp 4 with {model_dir}: tp=4 does not split linear_num_key_heads=2",
    }.items():
        seen = {r["errors"][case] for r in results}
        assert len(seen) == 1, f"{case}: the ranks differ: {seen}"
        message = seen.pop()
        assert message.startswith("ValueError: ") and words in message, message
        assert "\n" not in message, message


def _resume_worker(rank: int, world: int, model: str, root: str) -> dict[str, list[float]]:
    import torch.distributed as dist

    options = {"model_dir": model, "steps": 4}
    sharded = os.path.join(root, "sharded")
    straight = {
        "save": sharded,
        "save_every": 2,
        "check_parity": True,
        "export": os.path.join(root, "export"),
    }
    result = _run({**options, "cp_size": 2, "tp": 2, **straight})[1]
    losses = {"straight": result.losses}
    losses["straight_reference"] = [r.reference_loss for r in result.records if r.reference_loss]
    step2 = os.path.join(sharded, "step-2")
    untp = os.path.join(root, "untp")  # saved without --tp (the single-device order) at step 3
    losses["cp4"] = _run({**options, "cp_size": 4, "resume": step2, "save": untp, "save_every": 1})[1].losses
    back = {"cp_size": 2, "tp": 2, "fsdp": True, "resume": os.path.join(untp, "step-3")}
    losses["back_to_tp2"] = _run({**options, **back})[1].losses
    whole = {"save": os.path.join(root, "whole"), "checkpoint_format": "whole"}
    losses["dp2xtp2"] = _run({**options, "cp_size": 1, "tp": 2, "fsdp": True, "resume": step2, **whole})[
        1
    ].losses
    if rank == 0:  # the converter, as a user runs it
        from hyperpar_gdn.train.checkpoints.convert import main

        assert main([step2, os.path.join(root, "converted"), "--to", "whole"]) == 0
    dist.barrier()
    converted = os.path.join(root, "converted", "step-2")
    result = _run({**options, "cp_size": 2, "tp": 2, "resume": converted, "check_parity": True})[1]
    losses["from_whole"] = result.losses
    losses["from_whole_reference"] = [r.reference_loss for r in result.records if r.reference_loss]
    return losses


def test_tp_checkpoints_resume_at_other_meshes(model_dir: Path, tmp_path: Path) -> None:
    from hyperpar_gdn.train.checkpoints.convert import convert
    from hyperpar_gdn.train.checkpoints.whole import load_checkpoint

    losses = run_ranks(_resume_worker, 4, str(model_dir), str(tmp_path), timeout_s=400)[0]
    straight = losses["straight"]
    worst = {
        name: max(_rel(a, b) for a, b in zip(losses[name], straight[2:], strict=True))
        for name in ("cp4", "dp2xtp2", "from_whole")
    }
    worst["back_to_tp2"] = _rel(losses["back_to_tp2"][0], straight[3])
    assert all(err <= TOL for err in worst.values()), f"resumed runs differ (relative): {worst}"
    # the parity copy read the converted checkpoint as one device does: the layout is the single-device one
    reference = losses["from_whole_reference"]
    assert len(reference) == 2
    assert max(_rel(a, b) for a, b in zip(reference, straight[2:], strict=True)) <= TOL

    # without FSDP too, tp 2 trains as one process does
    assert len(losses["straight_reference"]) == 4
    assert max(_rel(a, b) for a, b in zip(straight, losses["straight_reference"], strict=True)) <= TOL

    # a whole checkpoint written at tp 2 (--fsdp) holds what the converter makes of the sharded one
    # of the uninterrupted run (rows out of place would differ by ~1; the gates' weights by ~1e-4,
    # as in the test above)
    _, whole, _ = load_checkpoint(tmp_path / "whole" / "step-4")
    _, converted, meta = load_checkpoint(tmp_path / "sharded" / "step-4")
    assert "row_orders" not in meta  # loaded whole, in the single-device order
    assert sorted(whole["model"]) == sorted(converted["model"])
    for name, expected in converted["model"].items():
        err = ((whole["model"][name] - expected).abs().max() / expected.abs().max()).item()
        assert err <= 5e-2, f"{name}: the tp 2 whole checkpoint differs from the converted one by {err:.1e}"
    # the same run's export (tp 2, no FSDP) and its last checkpoint converted, whole or to a
    # transformers directory: the same weights
    convert(tmp_path / "sharded" / "step-4", tmp_path / "transformers", to="transformers")
    for directory in ("export", "transformers"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / directory).state_dict()
        for name, expected in converted["model"].items():
            assert torch.equal(loaded[name], expected), f"{name}: {directory} differs from the checkpoint"


def test_tp_is_refused_where_it_does_not_run() -> None:
    """MindSpore trains with --tp 1 (one line, before any process group); torch takes --tp."""
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeBackend
    from hyperpar_gdn.train.backends.torch_backend import TorchBackend

    with pytest.raises(NotImplementedError) as caught:
        MindSporeBackend.check(TrainConfig(tp=2), "mindspore")
    assert str(caught.value) == (
        "--tp 2: scripts/train.py trains with tensor parallelism on torch (HP_PLATFORM=cpu / cuda / npu); "
        "HP_PLATFORM=mindspore trains here with --tp 1 (a MindSpore model splits by heads in a loop of "
        "your own: hyperpar_gdn.tensor_parallel.mindspore_apply)"
    )
    MindSporeBackend.check(TrainConfig(), "mindspore")  # accepted
    TorchBackend.check(TrainConfig(tp=2), "cpu")  # accepted


def test_the_memory_plan_counts_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    """--plan at tp 2: the mesh in its first line, about half the parameters of tp 1 per rank
    (the embedding stays whole); a model --tp does not split is one line naming --tp, from the
    options alone (before any process group)."""
    from hyperpar_gdn.planning.memory import estimate
    from hyperpar_gdn.train.memory_check import model_shape, plan_lines, step_options

    monkeypatch.setenv("WORLD_SIZE", "4")
    options = {"cp_mode": "p2p", "model_size": "small", "seq_len": 256, "batch_size": 2}
    lines = plan_lines(TrainConfig(**options, tp=2, cp_size=2), platform="cpu")
    assert "4 ranks = dp 1 x cp 2 x tp 2 (--cp-mode p2p" in lines[0], lines[0]
    params = {
        tp: estimate(model_shape(config), step_options(config, 4, platform="cpu")).terms["parameters"]
        for tp, config in ((1, TrainConfig(**options, cp_size=4)), (2, TrainConfig(**options, tp=2)))
    }
    assert 0.5 < params[2] / params[1] < 0.8, params
    with pytest.raises(ValueError) as caught:
        model_shape(TrainConfig(tp=8))
    assert str(caught.value).startswith("--tp 8 with --model-size tiny: tp=8 does not split "), caught.value
