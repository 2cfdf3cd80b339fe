"""The GDN layer in the head_tail layout (rank r holds pieces r and 2cp-1-r of 2*cp) equals the
single-device layer, every mode, cp 2 and 4, real gloo ranks, fp64: output shard, input-gradient
shard and every parameter gradient (summed over ranks); with padding, with GQA, with chunks
smaller than a piece, and with packed documents that cross piece boundaries (against transformers'
``Qwen3_5GatedDeltaNet`` run on each document alone, and our layer on the whole packed row)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import transformers_gdn_layer

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.verify import compare_with_reference
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.platform import get_platform

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")
TOL = 1e-10
HF_TOL = 1e-5  # transformers computes the gates in fp32 (docs/maths.md)
T = 112  # pieces of 28 (cp 2) and 14 (cp 4): not multiples of any chunk used


def _layer(num_k_heads: int, num_v_heads: int) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, num_k_heads, num_v_heads, 16, 8)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
        # slow decay, so the state entering each fragment matters to its outputs
        layer.A_log.copy_(torch.log(torch.empty_like(layer.A_log).uniform_(0.05, 0.5)))
        layer.dt_bias.add_(-4.0)
    return layer.double()


def _dense_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(1)
    x, cot = rng.standard_normal((2, T, 32)), rng.standard_normal((2, T, 32))
    mask = np.ones((2, T))
    mask[0, :9] = 0  # left padding across the first piece boundary at cp 4
    mask[1, -40:] = 0  # right padding over several pieces
    out = {}
    cases = (("Hk4-H8", (4, 8), 64, None), ("Hk2-H4-chunk8-mask", (2, 4), 8, mask))
    for mode, (name, heads, chunk, padding) in ((m, c) for m in MODES for c in cases):
        style = LinearAttentionContextParallel(mode, chunk_size=chunk, layout="head_tail")
        layer = style.apply(_layer(*heads), mesh)
        reference = _layer(*heads)
        out[f"{mode}/{name}"] = compare_with_reference(
            platform,
            mesh,
            layer,
            reference,
            x,
            cot,
            attention_mask=padding,
            dtype="float64",
            layout="head_tail",
        )
    return out


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"cp{w}")
def test_head_tail_matches_single_device(world: int) -> None:
    for rank, per_case in enumerate(run_ranks(_dense_worker, world, timeout_s=240)):
        assert len(per_case) == 2 * len(MODES)
        for case, errors in per_case.items():
            assert len(errors) == 2 + 9, errors  # output, input grad, nine parameters
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, f"rank {rank} {case}: {bad}"


# document boundaries; pieces start at multiples of 28 (cp 2) and 14 (cp 4)
DOCS = {
    "crossing": (0, 20, 60, 100, 112),  # 20..60 crosses 28 and 56 (a head into the other head/tail)
    "tiny": (0, 13, 14, 15, 57, 112),  # 1-token documents at a piece boundary (14)
}


def _packed_worker(rank: int, world: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    hf = transformers_gdn_layer(dtype=torch.float64)
    ours = GatedDeltaNet(32, 2, 4, 16, 8).double()
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(5)
    x, cot = (torch.randn(1, T, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    index = torch.as_tensor(TokenLayout.of("head_tail", [T // world] * world).positions(rank))
    errors = {}
    for name, cu in DOCS.items():
        references = {}
        for ref_name, module in (("hf", hf), ("ours", ours)):
            x_ref = x.clone().requires_grad_(True)
            module.zero_grad()
            if ref_name == "hf":  # every document alone through transformers' layer
                y = torch.cat([module(x_ref[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)], 1)
            else:
                y = module(x_ref, cu_seqlens=torch.tensor(cu))
            (y * cot).sum().backward()
            references[ref_name] = {"output": y.detach(), "dx": x_ref.grad} | {
                n: p.grad.clone() for n, p in module.named_parameters()
            }
        for mode in MODES:
            layer = LinearAttentionContextParallel(mode, chunk_size=8, layout="head_tail").apply(
                copy.deepcopy(ours), mesh
            )
            x_local = x[:, index].clone().requires_grad_(True)
            out = layer(x_local, cu_seqlens=torch.tensor(cu))
            (out * cot[:, index]).sum().backward()
            got = {"output": out.detach(), "dx": x_local.grad}
            for n, p in layer.named_parameters():
                got[n] = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
            for ref_name, ref in references.items():
                worst = 0.0
                for key, value in got.items():
                    expected = ref[key][:, index] if key in ("output", "dx") else ref[key]
                    scale = ref[key].abs().max().clamp_min(1e-300)
                    worst = max(worst, ((value - expected).abs().max() / scale).item())
                errors[f"{name}/{mode}/{ref_name}"] = worst
    return errors


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"cp{w}")
def test_head_tail_packed_documents_cross_pieces(world: int) -> None:
    for rank, errors in enumerate(run_ranks(_packed_worker, world, timeout_s=240)):
        assert len(errors) == len(DOCS) * len(MODES) * 2
        for key, err in errors.items():
            tol = HF_TOL if key.endswith("/hf") else TOL
            assert err <= tol, f"rank {rank} {key}: relative error {err:.2e} > {tol:.0e}"


def test_head_tail_needs_two_equal_pieces_per_rank() -> None:
    """Shards of different lengths (or of an odd length) stop every rank with the same error."""

    def worker(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        layer = LinearAttentionContextParallel("p2p", layout="head_tail").apply(_layer(2, 4), mesh)
        try:
            layer(torch.randn(1, 20 if rank == 0 else 24, 32, dtype=torch.float64))
        except ValueError as err:
            return str(err)
        return "no error"

    for message in run_ranks(worker, 2, timeout_s=60):
        assert "layout='head_tail' needs every CP rank to hold two pieces" in message, message
        assert "[20, 24]" in message, message
