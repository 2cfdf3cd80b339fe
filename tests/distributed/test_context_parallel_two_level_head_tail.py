"""Two-level CP in the head_tail layout (rank r holds pieces r and 2cp-1-r of 2cp): ulysses inside
each node over its ranks' head and tail pieces, the state mode across nodes over the nodes' two
segments each. Equals one device (fp64, 8 real gloo ranks, one launch): output shard, input
gradient and every parameter gradient summed over the ranks, against our layer on the whole
(packed) row and transformers' ``Qwen3_5GatedDeltaNet`` on each document alone; cp 8 as 4 x 2,
2 x 4 and 8 nodes of 1; documents crossing pieces, ranks and nodes."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from test_context_parallel_scan import _references
from tiny_models import transformers_gdn_layer

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.models import GatedDeltaNet

TOL, HF_TOL, T, CP = 1e-10, 1e-5, 96, 8
# (mode, inner_size, documents): 12 tokens per rank, pieces of 6
CASES = (
    ("ulysses+scan", 2, (0, 5, 19, 20, 33, 50, 71, 96)),
    ("ulysses+p2p", 4, (0, 11, 40, 96)),
    ("ulysses+all_gather", 2, None),
    ("ulysses+scan", 4, (0, 45, 47, 96)),
    ("ulysses+p2p", 1, None),
)


def _worker(rank: int, world: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    hf = transformers_gdn_layer(dtype=torch.float64)
    ours = GatedDeltaNet(32, 2, 4, 16, 8).double()
    ours.load_state_dict(hf.state_dict())
    index = torch.as_tensor(TokenLayout.of("head_tail", [T // world] * world).positions(rank))
    results = {}
    for case, (mode, inner, cu) in enumerate(CASES):
        gen = torch.Generator().manual_seed(case)
        x, cot = (torch.randn(1, T, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        refs = _references(ours, hf, x, cot, cu)
        style = LinearAttentionContextParallel(mode, chunk_size=4, inner_size=inner, layout="head_tail")
        layer = style.apply(copy.deepcopy(ours), mesh)
        x_local = x[:, index].clone().requires_grad_(True)
        out = layer(x_local, cu_seqlens=None if cu is None else torch.tensor(cu))
        (out * cot[:, index]).sum().backward()
        got = {"output": out.detach(), "dx": x_local.grad}
        for n, p in layer.named_parameters():
            got[n] = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
        for ref_name, ref in refs.items():
            worst = 0.0
            for key, value in got.items():
                expected = ref[key][:, index] if key in ("output", "dx") else ref[key]
                worst = max(worst, ((value - expected).abs().max() / ref[key].abs().max()).item())
            results[f"{mode}-inner{inner}/{ref_name}"] = worst
    return results


@pytest.mark.timeout(300)
def test_two_level_head_tail_matches_single_device() -> None:
    for rank, errors in enumerate(run_ranks(_worker, CP, timeout_s=280)):
        assert len(errors) == sum(1 + (cu is not None) for *_, cu in CASES), sorted(errors)
        for key, err in errors.items():
            tol = HF_TOL if key.endswith("/hf") else TOL
            assert err <= tol, f"rank {rank} {key}: relative error {err:.2e} > {tol:.0e}"
