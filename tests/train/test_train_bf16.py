"""``--dtype bf16`` on 2 gloo ranks (cp 2): bf16 compute with fp32 master weights, optimizer state
and checkpoints; the losses stay near the fp32 run's, and a checkpoint resumes across dtypes (fp32
to bf16 and back), with and without FSDP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from distributed_harness import run_ranks

from hyperpar_gdn.train import TrainConfig, Trainer, load_checkpoint

FAST = {"seq_len": 64, "batch_size": 4, "steps": 8, "seed": 3, "cp_mode": "p2p"}
# bf16 rounds every matmul input to 8 bits of mantissa; over these 8 steps the losses stay within
# 1.2e-4 (autocast) and 2.4e-4 (FSDP) of fp32's, relative, and a run resumed in the other dtype
# within 1.1e-4 of the straight run (measured). A wrong bf16 path (a lost gradient, bf16 master
# weights or optimizer state) moves them further; with the GDN state matmuls left to autocast the
# run fails outright (bf16 meets fp32 in the triangular solve).
REL_TOL = 2e-3


def _losses(options: dict[str, Any]) -> list[float]:
    trainer = Trainer(TrainConfig(**options))
    try:
        dtypes = {p.dtype for p in trainer.model.parameters()}
        assert dtypes == {torch.float32}, dtypes  # master weights
        return trainer.train().losses
    finally:
        trainer.close()


def _runs(rank: int, world: int, root: str, fsdp: bool) -> dict[str, list[float]]:
    out = {}
    for dtype in ("fp32", "bf16"):
        save = os.path.join(root, dtype)
        out[dtype] = _losses({**FAST, "dtype": dtype, "fsdp": fsdp, "save": save, "save_every": 4})
    for saved, resumed in (("fp32", "bf16"), ("bf16", "fp32")):
        resume = os.path.join(root, saved, "step-4")
        out[f"{saved}->{resumed}"] = _losses({**FAST, "dtype": resumed, "fsdp": fsdp, "resume": resume})
    return out


def _close(a: list[float], b: list[float], tol: float = REL_TOL) -> bool:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)) <= tol


def _check(out: dict[str, list[float]], root: Path) -> None:
    fp32, bf16 = out["fp32"], out["bf16"]
    assert len(bf16) == 8 and bf16 != fp32  # it did compute in bf16
    assert _close(bf16, fp32), (bf16, fp32)
    assert max(bf16[-2:]) < bf16[0] - 0.3  # and learned
    assert _close(out["fp32->bf16"], bf16[4:]), (out["fp32->bf16"], bf16[4:])
    assert _close(out["bf16->fp32"], fp32[4:]), (out["bf16->fp32"], fp32[4:])
    for dtype in ("fp32", "bf16"):
        _, parts, meta = load_checkpoint(root / dtype / "step-8")
        assert meta["config"]["dtype"] == dtype
        assert {t.dtype for t in parts["model"].values()} == {torch.float32}
        moments = [
            v for s in parts["optimizer"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")
        ]
        assert moments and {m.dtype for m in moments} == {torch.float32}


def test_bf16_near_fp32_and_resumes_across_dtypes(tmp_path: Path) -> None:
    _check(run_ranks(_runs, 2, str(tmp_path), False, timeout_s=240)[0], tmp_path)


def test_bf16_under_fsdp(tmp_path: Path) -> None:
    """FSDP2's MixedPrecisionPolicy: bf16 gathered parameters, fp32 shards and reductions."""
    _check(run_ranks(_runs, 2, str(tmp_path), True, timeout_s=240)[0], tmp_path)
