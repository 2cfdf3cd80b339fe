"""FSDP2 and activation checkpointing compose with context parallelism (real gloo ranks):
``--fsdp`` and ``--fsdp --ac`` give the plain dp x cp run's losses in every mode, and a
``--fsdp`` checkpoint resumes exactly, with or without ``--fsdp``."""

from __future__ import annotations

import os
from typing import Any

import pytest
from distributed_harness import run_ranks

from hyperpar_gdn.train import TrainConfig, Trainer

STEPS = 10
TOL = 1e-5  # fp32, per step: FSDP sums the same gradient shares in another order
FAST = {"seq_len": 64, "batch_size": 4, "steps": STEPS, "seed": 3}
VARIANTS = ({}, {"fsdp": True}, {"fsdp": True, "ac": True})


def _losses(options: dict[str, Any]) -> list[float]:
    trainer = Trainer(TrainConfig(**options))
    try:
        return trainer.train().losses
    finally:
        trainer.close()


def _variants(rank: int, world: int, options: dict[str, Any]) -> list[list[float]]:
    return [_losses({**options, **variant}) for variant in VARIANTS]


@pytest.mark.parametrize("mode", ["ulysses", "p2p", "all_gather"])
@pytest.mark.parametrize("world, cp", [(2, 2), (4, 2)], ids=["cp2", "dp2xcp2"])
def test_fsdp_and_ac_match_plain(world: int, cp: int, mode: str) -> None:
    options = {**FAST, "cp_mode": mode, "cp_size": cp}
    results = run_ranks(_variants, world, options, timeout_s=240)
    plain, fsdp, fsdp_ac = results[0]
    assert all(r == results[0] for r in results)  # every rank reports the global loss
    assert max(plain[-3:]) < plain[0] - 0.5
    for name, losses in (("--fsdp", fsdp), ("--fsdp --ac", fsdp_ac)):
        diff = max(abs(a - b) for a, b in zip(losses, plain, strict=True))
        assert diff <= TOL, f"{name} differs from the plain run by {diff:.3g}"


def _resumes(rank: int, world: int, root: str) -> dict[str, list[float]]:
    save = os.path.join(root, "ckpt")
    options = {**FAST, "cp_mode": "p2p", "cp_size": 2}
    straight = _losses({**options, "fsdp": True, "ac": True, "save": save, "save_every": 5})
    resume = {**options, "resume": os.path.join(save, "step-5")}
    return {
        "straight": straight,
        "fsdp": _losses({**resume, "fsdp": True}),
        "plain": _losses(resume),
    }


def test_fsdp_checkpoint_resumes_exactly(tmp_path: Any) -> None:
    result = run_ranks(_resumes, 4, str(tmp_path), timeout_s=240)[0]
    assert result["fsdp"] == result["straight"][5:]
    diff = max(abs(a - b) for a, b in zip(result["plain"], result["straight"][5:], strict=True))
    assert diff <= TOL
