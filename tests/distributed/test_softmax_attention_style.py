"""SoftmaxAttentionContextParallel and apply_context_parallel equal the single-device modules:
outputs, input gradients and every parameter gradient (summed over ranks), on real gloo ranks."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import TINY_LM, move_off_init

from hyperpar_gdn import init_device_mesh
from hyperpar_gdn.distributed.parallelize import apply_context_parallel, undo_context_parallel
from hyperpar_gdn.distributed.softmax_attention_style import SoftmaxAttentionContextParallel
from hyperpar_gdn.models.attention import CausalSelfAttention
from hyperpar_gdn.models.lm import HybridLM
from hyperpar_gdn.platform import get_platform

TOL = 1e-4  # fp32, relative to each tensor's scale


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _param_grads_summed(module: torch.nn.Module, group: object) -> dict[str, torch.Tensor]:
    comm = get_platform().collectives
    return {name: comm.all_reduce_sum(p.grad.clone(), group) for name, p in module.named_parameters()}


def _attention_errors(
    rank: int,
    world: int,
    seq_len: int,
    lengths: tuple[int, ...] | None = None,
    cu_seqlens: list[int] | None = None,
    path: str = "auto",
) -> dict[str, float]:
    """Errors of one CP forward+backward against the single-device layer; ``lengths``: uneven
    shards; ``cu_seqlens``: packed documents (B = 1); ``path``: HP_ATTENTION on both sides."""
    os.environ["HP_ATTENTION"] = path
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    reference = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
    parallel = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
    parallel.load_state_dict(reference.state_dict())
    SoftmaxAttentionContextParallel().apply(parallel, mesh)
    generator = torch.Generator().manual_seed(1)
    batch = 1 if cu_seqlens is not None else 2
    x = torch.randn(batch, seq_len, 32, generator=generator)
    cot = torch.randn(batch, seq_len, 32, generator=generator)
    lengths = lengths or (seq_len // world,) * world
    start = sum(lengths[:rank])
    shard = slice(start, start + lengths[rank])
    docs = None if cu_seqlens is None else torch.tensor(cu_seqlens)

    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref, cu_seqlens=docs)
    (y_ref * cot).sum().backward()
    x_local = x[:, shard].clone().requires_grad_()
    y_local = parallel(x_local, cu_seqlens=docs)
    (y_local * cot[:, shard]).sum().backward()

    errors = {"out": _rel_err(y_local, y_ref[:, shard]), "dx": _rel_err(x_local.grad, x_ref.grad[:, shard])}
    for name, grad in _param_grads_summed(parallel, mesh.get_group()).items():
        errors[f"d{name}"] = _rel_err(grad, dict(reference.named_parameters())[name].grad)
    SoftmaxAttentionContextParallel.undo(parallel)
    errors["undo"] = _rel_err(parallel(x, cu_seqlens=docs), y_ref.detach())
    return errors


@pytest.mark.parametrize(("world", "seq_len"), [(2, 24), (4, 36)], ids=["cp2-T24", "cp4-T36"])
def test_attention_cp_matches_single_device(world: int, seq_len: int) -> None:
    results = run_ranks(_attention_errors, world, seq_len, timeout_s=60)
    for rank, errors in enumerate(results):
        assert len(errors) == 2 + 6 + 1  # out, dx, 6 parameters, undo
        bad = {name: err for name, err in errors.items() if not err <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"


@pytest.mark.parametrize("path", ["auto", "blockwise"])
@pytest.mark.parametrize(
    ("world", "lengths", "cu_seqlens"),
    [((2), (7, 13), [0, 3, 11, 12, 20]), ((4), (5, 11, 9, 7), [0, 2, 9, 10, 23, 32])],
    ids=["cp2-uneven-packed", "cp4-uneven-packed"],
)
def test_attention_cp_uneven_packed_matches_single_device(
    world: int, lengths: tuple[int, ...], cu_seqlens: list[int], path: str
) -> None:
    """Shards of different lengths, documents that cross shard boundaries and one-token documents;
    the fused-kernel path (auto) and the generic blockwise path."""
    results = run_ranks(_attention_errors, world, sum(lengths), lengths, cu_seqlens, path, timeout_s=60)
    for rank, errors in enumerate(results):
        assert len(errors) == 2 + 6 + 1
        bad = {name: err for name, err in errors.items() if not err <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"


def _lm_errors(rank: int, world: int, mode: str, dtype: torch.dtype) -> dict[str, float]:
    """Per-tensor relative errors of the CP model's logits and summed parameter gradients."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    reference = HybridLM(TINY_LM)
    move_off_init(reference, 0.1)  # every gradient is exercised
    reference = reference.to(dtype)
    parallel = HybridLM(TINY_LM).to(dtype)
    parallel.load_state_dict(reference.state_dict())
    apply_context_parallel(parallel, mesh, mode=mode)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    t = ids.shape[1] // world
    shard = slice(rank * t, (rank + 1) * t)

    logits_ref = reference(ids)
    logits_ref.logsumexp(-1).sum().backward()
    logits = parallel(ids[:, shard])
    logits.logsumexp(-1).sum().backward()

    errors = {"logits": _rel_err(logits, logits_ref[:, shard])}
    ref_params = dict(reference.named_parameters())
    grad_scale = max(p.grad.abs().max().item() for p in ref_params.values())
    for name, grad in _param_grads_summed(parallel, mesh.get_group()).items():
        ref_grad = ref_params[name].grad
        if dtype == torch.float64:
            errors[f"d{name}"] = _rel_err(grad, ref_grad)
        else:  # fp32: the decay gradients of layer 0 are sums with heavy cancellation
            errors[f"d{name}"] = ((grad - ref_grad).abs().max() / grad_scale).item()
    undo_context_parallel(parallel)
    with torch.no_grad():
        errors["undo"] = _rel_err(parallel(ids), logits_ref)
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", ["ulysses", "p2p", "all_gather"])
def test_whole_model_cp_matches_single_device(mode: str, dtype: torch.dtype) -> None:
    """fp64: every tensor to 1e-10 of its own scale (the CP maths is exact); fp32: 1e-4."""
    tol = 1e-10 if dtype == torch.float64 else TOL
    results = run_ranks(_lm_errors, 2, mode, dtype, timeout_s=90)
    for rank, errors in enumerate(results):
        assert len(errors) == 2 + len(list(HybridLM(TINY_LM).parameters()))
        bad = {name: err for name, err in errors.items() if not err <= tol}
        assert not bad, f"rank {rank}: errors above {tol}: {bad}"


def _misuse(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    messages = []
    attn = CausalSelfAttention(16, num_heads=2, num_kv_heads=2, head_dim=8)
    style = SoftmaxAttentionContextParallel()
    style.apply(attn, mesh)
    for action in (
        lambda: style.apply(attn, mesh),
        lambda: SoftmaxAttentionContextParallel.undo(SoftmaxAttentionContextParallel.undo(attn)),
        lambda: style.apply(torch.nn.Linear(4, 4), mesh),
        lambda: apply_context_parallel(
            HybridLM(replace(TINY_LM, linear_num_value_heads=6)), mesh, mode="ulysses"
        ),
        lambda: apply_context_parallel(HybridLM(TINY_LM), mesh, mode="ring"),
    ):
        try:
            action()
            messages.append("no error")
        except (ValueError, TypeError) as err:
            messages.append(str(err))
    return messages


def test_misuse_is_a_clear_error() -> None:
    # 4 ranks: 6 GDN value heads do not split over ulysses cp=4
    messages = run_ranks(_misuse, 4, timeout_s=60)[0]
    assert "already has context parallelism applied" in messages[0]
    assert "has no context parallelism applied" in messages[1]
    assert "Linear has no project()" in messages[2]
    assert "layer 0: mode='ulysses' splits the value heads over the ranks: num_v_heads=6" in messages[3]
    assert "not divisible by cp=4" in messages[3]
    assert "mode='ring' is not a context-parallel mode" in messages[4]
