"""Every CP mode equals the single-device layer: output shard, input-gradient shard and every
parameter gradient (summed over ranks), on real gloo process groups; also with shards of
different lengths, and the head-parallel modes with q/k heads that cp does not divide."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.verify import compare_with_reference
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.platform import get_platform

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Case:
    num_k_heads: int
    num_v_heads: int
    seq_len: int
    masked: bool = False
    dtype: str = "float32"
    shards: tuple[int, ...] | None = None  # tokens per rank; None: T/cp each

    def __str__(self) -> str:
        shards = "" if self.shards is None else "-shards" + "_".join(map(str, self.shards))
        return f"Hk{self.num_k_heads}-H{self.num_v_heads}-T{self.seq_len}{'-mask' if self.masked else ''}-{self.dtype}{shards}"


CASES = (
    Case(4, 4, 96),  # local T 48 or 24: not a multiple of the 64 chunk
    Case(4, 8, 200),  # GQA, T/cp = 100 or 50
    Case(4, 4, 160, masked=True),  # padding mask
    Case(4, 8, 128, dtype="bfloat16"),
    Case(4, 8, 136, dtype="float64"),  # exact maths: any slip in the exchange shows
)


class _Solo:
    """A 1-rank axis, to run the plain layer alone inside a multi-rank job."""

    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _inputs(case: Case, hidden: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, case.seq_len, hidden))
    cot = rng.standard_normal((2, case.seq_len, hidden))
    mask = None
    if case.masked:
        mask = np.ones((2, case.seq_len))
        mask[0, :7] = 0  # left padding
        mask[1, -30:] = 0  # right padding
    return x, cot, mask


def _layer(case: Case, hidden: int) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden, case.num_k_heads, case.num_v_heads, 16, 8)
    with torch.no_grad():  # move every parameter off its init so each gradient is exercised
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
        # slow decay (|g| ~ 0.01 per token), so the state entering a shard matters to its output
        layer.A_log.copy_(torch.log(torch.empty_like(layer.A_log).uniform_(0.05, 0.5)))
        layer.dt_bias.add_(-4.0)
    return layer.to(getattr(torch, case.dtype))


def _check_mode(
    rank: int, world: int, mode: str, cases: tuple[Case, ...]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per case: the CP layer against the single-device layer in the same dtype ("same"); for
    float32 also both against the float64 truth ("cp_truth", "single_truth")."""
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    hidden = 32
    out = {}
    for case in cases:
        layer = LinearAttentionContextParallel(mode=mode).apply(_layer(case, hidden), mesh)
        x, cot, mask = _inputs(case, hidden)
        kwargs = {"attention_mask": mask, "dtype": case.dtype, "shard_lengths": case.shards}
        result = {
            "same": compare_with_reference(platform, mesh, layer, _layer(case, hidden), x, cot, **kwargs)
        }
        if case.dtype == "float32":
            truth = _layer(Case(**{**vars(case), "dtype": "float64"}), hidden)
            result["cp_truth"] = compare_with_reference(
                platform, mesh, layer, truth, x, cot, reference_dtype="float64", **kwargs
            )
            result["single_truth"] = compare_with_reference(
                platform, _Solo(), _layer(case, hidden), truth, x, cot, reference_dtype="float64", **kwargs
            )
        out[str(case)] = result
    return out


# cp = 1 runs the same one-device path whatever the mode: one mode checks it
@pytest.mark.parametrize(
    ("mode", "world"),
    [(mode, world) for mode in MODES for world in (2, 4)] + [("p2p", 1)],
    ids=lambda v: f"cp{v}" if isinstance(v, int) else v,
)
def test_mode_matches_single_device(mode: str, world: int) -> None:
    """float64 and bf16: CP equals the single-device layer within TOL. float32: within 1e-4 of
    it too, except where the single-device layer's own float32 rounding (measured against the
    float64 truth) is larger: there CP must be as close to the truth as the single device is."""
    results = run_ranks(_check_mode, world, mode, CASES, timeout_s=240)
    for rank, per_case in enumerate(results):
        for case in CASES:
            result = per_case[str(case)]
            same = result["same"]
            assert len(same) == 2 + 9, same  # output, input grad, nine parameters
            if case.dtype != "float32":
                bad = {k: v for k, v in same.items() if not v <= TOL[case.dtype]}
            else:
                cp_truth, single_truth = result["cp_truth"], result["single_truth"]
                bad = {
                    k: (v, cp_truth[k], single_truth[k])
                    for k, v in same.items()
                    if not (v <= TOL["float32"] or cp_truth[k] <= 2 * single_truth[k])
                }
            assert not bad, f"rank {rank} {case}: {bad}"


# ulysses gives rank r the value heads of its group and the q/k heads they use: only num_v_heads
# needs to divide cp. Hk6-H12 at cp=4 gives rank 0 value heads 0-2 on q/k heads 0, 0, 1.
GROUPED = {
    2: (Case(1, 2, 136, dtype="float64"), Case(3, 6, 136, dtype="float64")),
    4: (Case(2, 4, 136, dtype="float64"), Case(6, 12, 136, dtype="float64")),
}
# shards of different lengths: not multiples of the 64 chunk, and ranks holding only the conv
# halo (3 tokens), first, inside and last in the chain
UNEVEN = {
    2: (
        Case(4, 8, 136, dtype="float64", shards=(37, 99)),
        Case(2, 4, 100, masked=True, dtype="float64", shards=(97, 3)),
    ),
    4: (
        Case(4, 8, 136, dtype="float64", shards=(3, 70, 5, 58)),
        Case(2, 4, 150, masked=True, dtype="float64", shards=(64, 3, 80, 3)),
    ),
}


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"cp{w}")
@pytest.mark.parametrize("mode", ["ulysses", "ulysses_hidden"])
def test_ulysses_splits_value_heads_when_cp_does_not_divide_key_heads(mode: str, world: int) -> None:
    cases = GROUPED[world]
    assert all(c.num_k_heads % world and not c.num_v_heads % world for c in cases)
    for rank, per_case in enumerate(run_ranks(_check_mode, world, mode, cases, timeout_s=240)):
        for case in cases:
            same = per_case[str(case)]["same"]
            assert len(same) == 2 + 9, same
            bad = {k: v for k, v in same.items() if not v <= TOL["float64"]}
            assert not bad, f"rank {rank} {case}: {bad}"


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"cp{w}")
@pytest.mark.parametrize("mode", MODES)
def test_shards_of_different_lengths(mode: str, world: int) -> None:
    cases = UNEVEN[world]
    for rank, per_case in enumerate(run_ranks(_check_mode, world, mode, cases, timeout_s=240)):
        for case in cases:
            same = per_case[str(case)]["same"]
            assert len(same) == 2 + 9, same
            bad = {k: v for k, v in same.items() if not v <= TOL["float64"]}
            assert not bad, f"rank {rank} {case}: {bad}"
