"""Training on MindSpore under msrun (2 MCCL workers, one job for the whole module): the hybrid LM
with context parallelism equals the single-device MindSpore model (fp64, every mode), and
``scripts/train.py`` trains it with CP along the torch run's loss curve (no CP, same weights, same
batches)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from distributed_harness import run_ranks

pytest.importorskip("mindspore")

from msrun_harness import MsrunOutcome, run_msrun  # noqa: E402
from msrun_train_worker import lm_config  # noqa: E402  (tests/train is on sys.path under pytest)

from hyperpar_gdn.models.lm import HybridLM  # noqa: E402
from hyperpar_gdn.train import TrainConfig, Trainer  # noqa: E402

WORKER = Path(__file__).resolve().parent / "msrun_train_worker.py"
MODES = ("ulysses", "p2p", "all_gather")
STEPS = 10
OPTIONS = {"seq_len": 64, "batch_size": 4, "steps": STEPS, "seed": 3}
TRAIN_MODE = "all_gather"
# Per step, |loss(MindSpore, CP) - loss(torch, no CP)|: the torch CP parity tolerance. Measured
# <= 1.4e-6 over these 10 steps (p2p and all_gather): fp32 rounding of two frameworks' kernels,
# which 10 steps at lr 1e-3 do not amplify much.
LOSS_TOL = 1e-4
LM_TOL = 1e-10  # fp64: the CP maths is exact, rounding only


def _flags(options: dict[str, Any]) -> list[str]:
    return [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]


@cache
def _job() -> MsrunOutcome:
    args = ["--sections", "lm_cp", "train", "--", *_flags({**OPTIONS, "cp_mode": TRAIN_MODE})]
    return run_msrun(WORKER, 2, args, timeout_s=180)


def _section(name: str) -> list[dict[str, Any]]:
    outcome = _job()
    data = []
    for rank, result in enumerate(outcome.results):
        if result is None or name not in result["sections"]:
            raise AssertionError(f"rank {rank} has no result for {name!r}\n{outcome.describe()}")
        entry = result["sections"][name]
        assert entry["ok"], f"rank {rank} failed in {name!r}:\n{entry['error']}"
        data.append(entry["data"])
    assert outcome.ok, outcome.describe()
    return data


def _torch_losses(rank: int, world: int, options: dict[str, Any]) -> list[float]:
    trainer = Trainer(TrainConfig(**options))
    try:
        return trainer.train().losses
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", MODES)
def test_lm_cp_equals_single_device_on_mindspore(mode: str) -> None:
    num_params = len(list(HybridLM(lm_config()).parameters()))
    for rank, results in enumerate(_section("lm_cp")):
        errors = results[mode]
        assert len(errors) == 2 + num_params  # logits, undo, every parameter's gradient
        bad = {name: err for name, err in errors.items() if not err <= LM_TOL}
        assert not bad, f"rank {rank} {mode}: errors above {LM_TOL}: {bad}"


def test_train_script_follows_the_torch_loss_curve() -> None:
    rank0, rank1 = _section("train")
    assert rank0["exit_code"] == rank1["exit_code"] == 0
    assert (rank0["platform"], rank0["world_size"], rank0["dp_size"], rank0["cp_size"]) == (
        "mindspore",
        2,
        1,
        2,
    )
    assert rank0["steps"] == list(range(1, STEPS + 1))
    losses = rank0["losses"]
    assert losses[0] > 5.0  # ~ln 256 at init
    assert max(losses[-3:]) < losses[0] - 0.5
    torch_losses = run_ranks(_torch_losses, 1, {**OPTIONS, "cp_size": 1}, timeout_s=120)[0]
    diffs = [abs(a - b) for a, b in zip(losses, torch_losses, strict=True)]
    assert max(diffs) <= LOSS_TOL, f"MindSpore {losses}\ntorch {torch_losses}\n|diff| {diffs}"


@pytest.mark.parametrize(
    ("option", "value"), [("save", "ckpt"), ("resume", "ckpt/step-3")], ids=["save", "resume"]
)
def test_checkpoint_options_are_refused_by_name(
    option: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyperpar_gdn.train.mindspore_loop import MindSporeTrainer

    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    with pytest.raises(NotImplementedError, match=rf"--{option} is not implemented on MindSpore yet"):
        MindSporeTrainer(TrainConfig(**{option: value}))
    monkeypatch.setenv("HP_PLATFORM", "cpu")
    with pytest.raises(
        NotImplementedError, match=r"MindSporeTrainer needs HP_PLATFORM=mindspore \(got cpu\)"
    ):
        MindSporeTrainer(TrainConfig())
