"""Two-level CP (``mode="ulysses+<state mode>"``, ``inner_size``): ulysses inside groups of
consecutive ranks, p2p / all_gather / scan across them, equals one device (fp64, real gloo
ranks): output shard, input-gradient shard and every parameter gradient summed over the ranks,
with shards of different lengths and packed documents crossing shards and nodes (references:
our layer on the whole packed row; transformers' ``Qwen3_5GatedDeltaNet`` on each document
alone). cp 6 = 3 nodes x 2 and 6 x 1, cp 8 = 4 x 2 and 2 x 4; beside data parallelism (a
(dp, cp) = (2, 4) mesh, cp 4 = 2 x 2, each replica its own sequence, in the cp 8 launch); a CP
axis whose ranks are 2 apart (the cp axis of a (cp, tp) mesh); bad options refused."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from test_context_parallel_scan import _references
from tiny_models import transformers_gdn_layer

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.models import GatedDeltaNet

TOL, HF_TOL = 1e-10, 1e-5
# (mode, inner_size, shard lengths, documents) per world; the GDN layer has 4 value heads
CASES = {
    6: (
        ("ulysses+scan", 2, (5, 9, 8, 4, 10, 6), (0, 5, 19, 20, 33, 42)),
        ("ulysses+scan", 1, (5, 9, 8, 4, 10, 6), None),
        ("ulysses+p2p", 2, (7,) * 6, (0, 3, 30, 42)),
    ),
    8: (
        ("ulysses+scan", 2, (6, 4, 8, 5, 7, 4, 6, 8), (0, 5, 19, 20, 33, 48)),
        ("ulysses+p2p", 4, (6, 4, 8, 5, 7, 4, 6, 8), (0, 11, 40, 48)),
        ("ulysses+all_gather", 2, (6,) * 8, None),
    ),
}


def _case(mesh, ours, hf, mode: str, inner: int, lengths, cu, *, seed: int = 11) -> dict[str, float]:
    """One case on the 1-D CP ``mesh``: the worst relative error against each reference."""
    rank = mesh.get_local_rank()
    t = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    x, cot = (torch.randn(1, t, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    refs = _references(ours, hf, x, cot, cu)
    lo = sum(lengths[:rank])
    window = slice(lo, lo + lengths[rank])
    style = LinearAttentionContextParallel(mode, chunk_size=4, inner_size=inner)
    layer = style.apply(copy.deepcopy(ours), mesh)
    x_local = x[:, window].clone().requires_grad_(True)
    out = layer(x_local, cu_seqlens=None if cu is None else torch.tensor(cu))
    (out * cot[:, window]).sum().backward()
    got = {"output": out.detach(), "dx": x_local.grad}
    for n, p in layer.named_parameters():
        got[n] = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
    errors = {}
    for ref_name, ref in refs.items():
        worst = 0.0
        for key, value in got.items():
            expected = ref[key][:, window] if key in ("output", "dx") else ref[key]
            worst = max(worst, ((value - expected).abs().max() / ref[key].abs().max()).item())
        errors[ref_name] = worst
    return errors


def _worker(rank: int, world: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    hf = transformers_gdn_layer(dtype=torch.float64)
    ours = GatedDeltaNet(32, 2, 4, 16, 8).double()
    ours.load_state_dict(hf.state_dict())
    results = {}
    for mode, inner, lengths, cu in CASES[world]:
        for ref_name, err in _case(mesh, ours, hf, mode, inner, lengths, cu).items():
            results[f"{mode}-inner{inner}/{ref_name}"] = err
    if world == 8:  # data parallelism beside: 2 replicas of cp 4 = 2 x 2, each its own sequence
        dp_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "cp"))
        replica = dp_mesh.get_local_rank("dp")
        errors = _case(dp_mesh["cp"], ours, hf, "ulysses+scan", 2, (6, 4, 8, 5), (0, 5, 13, 23), seed=replica)
        for ref_name, err in errors.items():
            results[f"dp2-ulysses+scan-inner2/{ref_name}"] = err
        # the cp axis of a (cp, tp)-like mesh: cp ranks 2 apart (tensor parallelism innermost)
        strided = init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "tp"))
        errors = _case(strided["cp"], ours, hf, "ulysses+p2p", 2, (5, 7, 4, 8), None, seed=3)
        for ref_name, err in errors.items():
            results[f"strided-ulysses+p2p-inner2/{ref_name}"] = err
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", sorted(CASES), ids=lambda w: f"cp{w}")
def test_two_level_matches_single_device(world: int) -> None:
    expected = sum(1 + (cu is not None) for *_, cu in CASES[world]) + (3 if world == 8 else 0)
    for rank, errors in enumerate(run_ranks(_worker, world, timeout_s=280)):
        assert len(errors) == expected, sorted(errors)
        for key, err in errors.items():
            tol = HF_TOL if key.endswith("/hf") else TOL
            assert err <= tol, f"rank {rank} {key}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "ulysses+scan"}, ValueError, "inner_size is given with the two-level modes"),
        ({"mode": "scan", "inner_size": 2}, ValueError, "got mode='scan', inner_size=2"),
        ({"mode": "ulysses+scan", "inner_size": 0}, ValueError, "inner_size must be a positive int; got 0"),
        (
            {"mode": "ulysses+ring", "inner_size": 2},
            ValueError,
            "mode='ulysses+ring' is not a context-parallel mode",
        ),
    ],
)
def test_bad_options(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message.replace("+", r"\+").replace("(", r"\(")):
        LinearAttentionContextParallel(**kwargs)


def test_inner_size_must_divide_cp_and_heads() -> None:
    def worker(rank: int, world: int) -> list[str]:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        messages = []
        for inner, heads in ((3, 4), (2, 3)):
            try:
                LinearAttentionContextParallel("ulysses+scan", inner_size=inner).apply(
                    GatedDeltaNet(32, 1, heads, 16, 8), mesh
                )
            except ValueError as err:
                messages.append(str(err))
        return messages

    for messages in run_ranks(worker, 4, timeout_s=60):
        assert "inner_size=3 does not divide cp=4" in messages[0], messages
        assert "num_v_heads=3 is not divisible by cp=2" in messages[1], messages
