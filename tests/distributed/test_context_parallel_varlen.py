"""Packed documents under context parallelism (real gloo ranks), every mode, cp 2 and 4: the GDN
layer's output shard, input gradient and every parameter gradient (summed over ranks) equal each
document run alone on one device, through our layer (fp64, exact up to rounding) and through
transformers' ``Qwen3_5GatedDeltaNet`` (fp32 gates, docs/maths.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import transformers_gdn_layer

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.models import GatedDeltaNet

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")
T = 96
TOL = 1e-10  # fp64 against our layer per document
HF_TOL = 1e-5  # against transformers' layer per document (its gates are fp32)
# Global document boundaries; the shard boundaries are at 48 (cp 2) and 24, 48, 72 (cp 4).
CASES = {
    "crossing": (0, 30, 70, 96),  # documents crossing one shard boundary
    "tiny-and-long": (0, 1, 3, 10, 60, 96),  # 1 and 2 tokens (< conv halo); 10..60 crosses 24 and 48
    "at-shard-start": (0, 48, 72, 96),
    "short-across": (0, 47, 49, 50, 96),  # a 2-token document across 48, then a 1-token one
    "one-document": (0, 96),
}


def _layers() -> tuple[GatedDeltaNet, torch.nn.Module]:
    hf = transformers_gdn_layer(dtype=torch.float64)
    ours = GatedDeltaNet(32, 2, 4, 16, 8).double()
    ours.load_state_dict(hf.state_dict())
    return ours, hf


def _per_document(layer: torch.nn.Module, x: torch.Tensor, cot: torch.Tensor, cu: tuple[int, ...]) -> dict:
    x = x.detach().requires_grad_(True)
    layer.zero_grad()
    out = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)], 1)
    (out * cot).sum().backward()
    return {"output": out.detach(), "dx": x.grad} | {n: p.grad.clone() for n, p in layer.named_parameters()}


def _worker(rank: int, world: int, lengths: tuple[int, ...]) -> dict[str, dict[str, float]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ours, hf = _layers()
    gen = torch.Generator().manual_seed(5)
    x, cot = (torch.randn(1, T, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    lo = sum(lengths[:rank])
    window = slice(lo, lo + lengths[rank])
    errors = {}
    for name, cu in CASES.items():
        references = {"ours": _per_document(ours, x, cot, cu), "hf": _per_document(hf, x, cot, cu)}
        for mode in MODES:
            layer = LinearAttentionContextParallel(mode).apply(copy.deepcopy(ours), mesh)
            x_local = x[:, window].clone().requires_grad_(True)
            out = layer(x_local, cu_seqlens=torch.tensor(cu))
            (out * cot[:, window]).sum().backward()
            got = {"output": out.detach(), "dx": x_local.grad}
            for n, p in layer.named_parameters():
                got[n] = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
            for ref_name, ref in references.items():
                worst = 0.0
                for key, value in got.items():
                    expected = ref[key][:, window] if key in ("output", "dx") else ref[key]
                    scale = ref[key].abs().max().clamp_min(1e-300)
                    worst = max(worst, ((value - expected).abs().max() / scale).item())
                errors[f"{name}/{mode}/{ref_name}"] = worst
    return errors


@pytest.mark.parametrize(
    "lengths",
    [(48, 48), (24, 24, 24, 24), (40, 56), (30, 18, 24, 24)],
    ids=["cp2", "cp4", "cp2-uneven", "cp4-uneven"],
)
def test_packed_documents_equal_each_document_alone(lengths: tuple[int, ...]) -> None:
    for rank, errors in enumerate(run_ranks(_worker, len(lengths), lengths, timeout_s=240)):
        for key, err in errors.items():
            tol = HF_TOL if key.endswith("/hf") else TOL
            assert err <= tol, f"rank {rank} {key}: relative error {err:.2e} > {tol:.0e}"


def test_position_ids_are_refused_under_cp() -> None:
    def worker(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        layer = LinearAttentionContextParallel("p2p").apply(_layers()[0], mesh)
        try:
            layer(torch.randn(1, 8, 32, dtype=torch.float64), position_ids=torch.arange(8)[None])
        except ValueError as err:
            return str(err)
        return "no error"

    for message in run_ranks(worker, 2, timeout_s=60):
        assert "pass the global cu_seqlens" in message or "refused their input" in message, message
