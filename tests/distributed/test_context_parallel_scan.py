"""``mode="scan"`` (an exclusive prefix scan of the summaries, ceil(log2 n) point-to-point rounds)
equals one device at cp 2, 3, 4, 5 and 8: output shard, input-gradient shard and every parameter
gradient (summed over the ranks), fp64, real gloo ranks, with shards of different lengths, the
head_tail layout, no documents and packed documents that cross shards and pieces (references:
our layer on the whole packed row, and transformers' ``Qwen3_5GatedDeltaNet`` run on each
document alone), and a prefill's final state on uneven contiguous shards. The sends are counted: each rank sends once per round it takes part in, and
the first fragment's owner (forward) and the last one's (backward) in every one of the
ceil(log2 n) rounds.

One launch of 8 ranks; each cp size runs on a subgroup of the first cp ranks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import transformers_gdn_layer

from hyperpar_gdn import LinearAttentionContextParallel
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.planning.cost_model import scan_rounds
from hyperpar_gdn.platform import get_platform

WORLD = 8
TOL = 1e-10  # fp64 against our layer on the whole row
HF_TOL = 1e-5  # against transformers' layer per document (its gates are fp32)
# contiguous shards of different lengths, T = 48 (each >= the conv halo of 3)
UNEVEN = {
    2: (30, 18),
    3: (10, 20, 18),
    4: (16, 8, 12, 12),
    5: (8, 12, 6, 10, 12),
    8: (6, 4, 8, 5, 7, 4, 6, 8),
}
DOCS = (0, 5, 19, 20, 33, 48)  # a 1-token document at 19; 20..33 and 5..19 cross shards
PIECE = {2: 12, 3: 8, 4: 6, 5: 5, 8: 3}  # head_tail: T = 2 cp x piece (48, 48, 48, 50, 48)


def _head_tail_docs(t: int) -> tuple[int, ...]:
    return (0, 7, 23, t - 10, t)


def _owners(cp: int, layout: str) -> list[int]:
    """The rank holding each fragment of the sequence, in order (head_tail: pieces r and 2cp-1-r)."""
    return list(range(cp)) if layout == "contiguous" else [*range(cp), *reversed(range(cp))]


def _expected_sends(cp: int, layout: str, rank: int) -> tuple[int, int]:
    """(forward, backward) sends of ``rank``: element i sends to i + d for d = 1, 2, 4, ... < n
    when another rank holds i + d; backward, the same over the reversed order."""
    owners = _owners(cp, layout)
    counts = []
    for order in (owners, owners[::-1]):
        n = len(order)
        strides = [2**j for j in range(math.ceil(math.log2(n)))]
        counts.append(
            sum(1 for d in strides for i in range(n - d) if order[i] == rank and order[i + d] != rank)
        )
    return counts[0], counts[1]


def _references(ours: GatedDeltaNet, hf: torch.nn.Module, x: torch.Tensor, cot: torch.Tensor, cu) -> dict:
    """Output, input gradient and parameter gradients: ours on the whole (packed) row, and
    transformers' layer on each document alone (when there are documents)."""
    refs = {}
    for name, module in (("ours", ours), ("hf", hf)):
        if name == "hf" and cu is None:
            continue
        x_ref = x.clone().requires_grad_(True)
        module.zero_grad()
        if name == "hf":
            y = torch.cat([module(x_ref[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)], 1)
        else:
            y = module(x_ref, cu_seqlens=None if cu is None else torch.tensor(cu))
        (y * cot).sum().backward()
        refs[name] = {"output": y.detach(), "dx": x_ref.grad} | {
            n: p.grad.clone() for n, p in module.named_parameters()
        }
    return refs


def _run_case(mesh, ours, hf, layout: str, lengths: list[int], cu) -> dict[str, object]:
    platform, rank = mesh.platform, mesh.get_local_rank()
    t = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    x, cot = (torch.randn(1, t, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    refs = _references(ours, hf, x, cot, cu)
    index = torch.as_tensor(TokenLayout.of(layout, lengths).positions(rank))
    layer = LinearAttentionContextParallel("scan", chunk_size=4, layout=layout).apply(
        copy.deepcopy(ours), mesh
    )
    comm = platform.collectives
    sent: list[tuple[int, ...]] = []
    exchange = comm.exchange

    def recorded(sends, recvs, group):
        sent.extend(tuple(x.shape) for x, _ in sends)
        return exchange(sends, recvs, group)

    comm.exchange = recorded
    try:
        x_local = x[:, index].clone().requires_grad_(True)
        out = layer(x_local, cu_seqlens=None if cu is None else torch.tensor(cu))
        forward_sends = list(sent)
        (out * cot[:, index]).sum().backward()
    finally:
        del comm.exchange  # the instance attribute: the class's exchange again
    got = {"output": out.detach(), "dx": x_local.grad}
    for n, p in layer.named_parameters():
        got[n] = comm.all_reduce_sum(p.grad.clone(), mesh.get_group())
    errors = {}
    for ref_name, ref in refs.items():
        worst = 0.0
        for key, value in got.items():
            expected = ref[key][:, index] if key in ("output", "dx") else ref[key]
            scale = ref[key].abs().max().clamp_min(1e-300)
            worst = max(worst, ((value - expected).abs().max() / scale).item())
        errors[ref_name] = worst
    if cu is None:  # a prefill's final state, in either layout
        errors["final_state"] = _final_state_error(layer, ours, x, index, cu)
    return {
        "errors": errors,
        "forward_sends": forward_sends,
        "backward_sends": len(sent) - len(forward_sends),
    }


def _final_state_error(layer, ours, x: torch.Tensor, index: torch.Tensor, cu) -> float:
    cu_t = None if cu is None else torch.tensor(cu)
    got, ref = PrefillStates(), PrefillStates()
    with torch.no_grad():
        layer(x[:, index], cu_seqlens=cu_t, prefill_states=got)
        ours(x, cu_seqlens=cu_t, prefill_states=ref)
    state, expected = got.gdn[id(layer)][1], ref.gdn[id(ours)][1]
    return ((state - expected).abs().max() / expected.abs().max()).item()


def _worker(rank: int, world: int) -> dict[str, dict[str, object]]:
    platform = get_platform()
    hf = transformers_gdn_layer(dtype=torch.float64)
    ours = GatedDeltaNet(32, 2, 4, 16, 8).double()
    ours.load_state_dict(hf.state_dict())
    results = {}
    for cp in UNEVEN:
        group = platform.new_group(list(range(cp)))  # every rank calls it, members or not
        if rank >= cp:
            continue
        mesh = DeviceMesh.from_group(platform, group, list(range(cp)), mesh_dim_name="cp", device_type="cpu")
        t = 2 * cp * PIECE[cp]
        cases = {
            "uneven": ("contiguous", list(UNEVEN[cp]), None),
            "uneven-packed": ("contiguous", list(UNEVEN[cp]), DOCS),
            "head_tail-packed": ("head_tail", [t // cp] * cp, _head_tail_docs(t)),
        }
        for name, (layout, lengths, cu) in cases.items():
            results[f"cp{cp}/{name}"] = _run_case(mesh, ours, hf, layout, lengths, cu)
    return results


@pytest.mark.timeout(300)
def test_scan_matches_single_device_in_log_rounds() -> None:
    per_rank = run_ranks(_worker, WORLD, timeout_s=280)
    for rank, results in enumerate(per_rank):
        expected_cases = 3 * sum(1 for cp in UNEVEN if rank < cp)
        assert len(results) == expected_cases, sorted(results)
        for case, result in results.items():
            cp = int(case.split("/")[0][2:])
            layout = "head_tail" if "head_tail" in case else "contiguous"
            for ref_name, err in result["errors"].items():
                tol = HF_TOL if ref_name == "hf" else TOL  # final_state: ours on the whole row
                assert err <= tol, f"rank {rank} {case} vs {ref_name}: relative error {err:.2e} > {tol:.0e}"
            forward, backward = _expected_sends(cp, layout, rank)
            assert (len(result["forward_sends"]), result["backward_sends"]) == (forward, backward), (
                f"rank {rank} {case}: sends {result['forward_sends']}, {result['backward_sends']}"
            )
            n = cp if layout == "contiguous" else 2 * cp
            if rank == 0:  # the first fragment's owner takes part in every round, sending S only
                assert len(result["forward_sends"]) == scan_rounds(n) == math.ceil(math.log2(n))
                assert all(shape[-1] == 8 for shape in result["forward_sends"]), result["forward_sends"]
            if rank == cp - 1 and layout == "contiguous":
                assert backward == scan_rounds(cp)
