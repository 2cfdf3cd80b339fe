"""msrun sections for tensor parallelism on MindSpore (4 workers: a (cp, tp) = (2, 2) mesh, tp
innermost), asserted in tests/tensor_parallel/test_mindspore_styles.py. Run by
``tests/distributed/msrun_cp_worker.py`` in the shared 4-worker job.

- ``tp_layers``: the MindSpore GDN layer and ``CausalSelfAttention`` split by heads over the tp
  axis (:mod:`hyperpar_gdn.tensor_parallel.mindspore_styles`), then context parallelism over the
  cp axis (every one-level GDN mode; both layouts; packed documents), and tp = 2 alone; float32.
  Per case the relative errors against the same layer on one device: the output shard, the
  input-gradient shard and every parameter gradient (summed over cp, the TP parts put back
  together); the TP parts of the weights put back together against the one-device weights; the
  local parameter shapes; the bytes this rank sent in the forward and backward; the ranks of this
  rank's cp and tp groups; what the cell's ``HeadShard`` says (kind, size, rank, the whole sizes,
  the largest difference between its weights and the whole layer's at the rank's heads) and
  whether the one-device cell has none.
- ``tp_model``: the whole MindSpore Qwen3.5 model (dense and MoE) under ``apply_tensor_parallel`` then
  ``apply_context_parallel`` (p2p, head_tail) against one device; a refused model.
- ``tp_bad_input``: wrong set-ups, the same on every rank: (error type, message), whether the
  cell's parameters were left as they were, and one all-gather after them (the ranks in step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hyperpar_gdn import LinearAttentionContextParallel, SoftmaxAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.verify import relative_error
from hyperpar_gdn.platform import Platform

HIDDEN, T = 32, 48
CU = (0, 5, 21, 22, 40, 48)  # documents across the shards of cp 2 (24) and the head_tail pieces (12)
GDN_CASES = (  # (mode or None for tp alone, layout, packed documents)
    (None, "contiguous", False),
    ("p2p", "contiguous", False),
    ("all_gather", "contiguous", True),
    ("scan", "head_tail", True),
    ("ulysses", "contiguous", False),
    ("ulysses_hidden", "head_tail", False),
)
ATTENTION_CASES = (  # (K/V heads: 2 split over tp 2, 1 whole on both ranks), layout, packed documents
    (2, "contiguous", True),
    (1, "head_tail", True),
    (2, None, False),  # tp alone
)


def _seeded(cell: Any, seed: int) -> Any:
    """Every parameter of ``cell`` drawn from a seeded generator (the same on every rank): vectors
    (norm weights, A_log, dt_bias) around 1, matrices 0.2 x standard normal."""
    import mindspore as ms

    rng = np.random.default_rng(seed)
    for _, p in cell.parameters_and_names():
        value = rng.standard_normal(p.shape)
        value = 1 + 0.1 * value if len(p.shape) == 1 else 0.2 * value
        p.set_data(ms.Tensor(value.astype(np.float32)))
    return cell


def gdn(num_k_heads: int = 2, num_v_heads: int = 4) -> Any:
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    return _seeded(GatedDeltaNet(HIDDEN, num_k_heads, num_v_heads, 16, 8), 1)


def attention(num_heads: int = 4, num_kv_heads: int = 2) -> Any:
    from hyperpar_gdn.models.mindspore import CausalSelfAttention

    layer = CausalSelfAttention(HIDDEN, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8)
    return _seeded(layer, 2)


def _run(platform: Platform, cell: Any, x: np.ndarray, cot: np.ndarray, cu: Any) -> dict[str, Any]:
    out, (dx,), grads = platform.value_and_grads(
        lambda inp: cell(inp, cu_seqlens=cu),
        [platform.from_numpy(x)],
        platform.from_numpy(cot),
        cell,
    )
    return {"output": out, "dx": dx, **grads}


def _case(
    platform: Platform, mesh: Any, make: Callable[[], Any], tp_style: Any, cp_style: Any, cu: Any, seed: int
) -> dict[str, Any]:
    """One layer under TP (and CP when ``cp_style``) against the same layer on one device."""
    from hyperpar_gdn.tensor_parallel.mindspore_apply import whole_parameters

    tp_mesh, cp_mesh, comm = mesh["tp"], mesh["cp"], platform.collectives
    rng = np.random.default_rng(seed)
    x, cot = rng.standard_normal((1, T, HIDDEN)), rng.standard_normal((1, T, HIDDEN))
    single_cell = make()
    whole_weights = {n: p.asnumpy() for n, p in single_cell.parameters_and_names()}
    single = {k: platform.to_numpy(v) for k, v in _run(platform, single_cell, x, cot, cu).items()}
    cell = tp_style.apply(make(), tp_mesh)
    shard = _shard_record(cell, single_cell, whole_weights)
    local_shapes = {n: list(p.shape) for n, p in cell.parameters_and_names()}
    weights = whole_parameters(cell, dict(cell.parameters_and_names()), tp_mesh)
    index: Any = slice(None)
    if cp_style is not None:
        cp_style.apply(cell, cp_mesh)
        index = TokenLayout.of(cp_style.layout, [T // cp_mesh.size()] * cp_mesh.size()).positions(
            cp_mesh.get_local_rank()
        )
    comm.reset_bytes()
    got = _run(platform, cell, x[:, index], cot[:, index], cu)
    sent = comm.reset_bytes()
    grads = {
        k: v if cp_style is None else comm.all_reduce_sum(v, cp_mesh.get_group())
        for k, v in got.items()
        if k not in ("output", "dx")
    }
    whole = whole_parameters(cell, grads, tp_mesh)
    errors = {k: relative_error(platform.to_numpy(got[k]), single[k][:, index]) for k in ("output", "dx")}
    errors.update({k: relative_error(v, single[k]) for k, v in whole.items()})
    return {
        "errors": errors,
        "bytes_sent": sent,
        "weights": {k: float(np.abs(v - whole_weights[k]).max()) for k, v in weights.items()},
        "local_shapes": local_shapes,
        "whole_shapes": {k: list(v.shape) for k, v in whole_weights.items()},
        "shard": shard,
    }


def _shard_record(cell: Any, single_cell: Any, whole_weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The split ``cell``'s HeadShard: its fields, and how far its weights are from the whole
    layer's at this rank's heads (a GDN layer's A_log and dt_bias; an attention's o_proj columns)."""
    from hyperpar_gdn.ops.head_shard import head_shard_of

    shard = head_shard_of(cell)
    weights = shard.weights()
    if shard.kind == "gdn":
        heads = list(shard.owned(shard.sizes[2]))
        local = {"A_log": weights.a_log, "dt_bias": weights.dt_bias}
        expected = {name: whole_weights[name][heads] for name in local}
    else:
        d = int(cell.head_dim)
        columns = [h * d + j for h in shard.owned(shard.sizes[0]) for j in range(d)]
        local = {"o_proj.weight": weights[3]}
        expected = {"o_proj.weight": whole_weights["o_proj.weight"][:, columns]}
    return {
        "kind": shard.kind,
        "size": shard.size,
        "rank": shard.rank,
        "sizes": list(shard.sizes),
        "whole_has_none": head_shard_of(single_cell) is None,
        "heads": max(float(np.abs(v.asnumpy() - expected[k]).max()) for k, v in local.items()),
    }


def section_tp_layers(platform: Platform, world: int) -> dict[str, Any]:
    from hyperpar_gdn.tensor_parallel.mindspore_styles import (
        AttentionTensorParallel,
        GatedDeltaNetTensorParallel,
    )

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    results: dict[str, Any] = {"cp_ranks": mesh["cp"].rank_list, "tp_ranks": mesh["tp"].rank_list}
    for seed, (mode, layout, packed) in enumerate(GDN_CASES):
        cp_style = None if mode is None else LinearAttentionContextParallel(mode, chunk_size=8, layout=layout)
        key = f"gdn/{mode or 'tp_only'}/{layout}{'/packed' if packed else ''}"
        cu = np.asarray(CU) if packed else None
        results[key] = _case(platform, mesh, gdn, GatedDeltaNetTensorParallel(), cp_style, cu, seed)
    for seed, (kv_heads, layout, packed) in enumerate(ATTENTION_CASES):
        cp_style = None if layout is None else SoftmaxAttentionContextParallel(layout=layout)
        key = f"attention/kv{kv_heads}/{layout or 'tp_only'}{'/packed' if packed else ''}"
        cu = np.asarray(CU) if packed else None
        make = lambda kv=kv_heads: attention(4, kv)  # noqa: E731
        results[key] = _case(platform, mesh, make, AttentionTensorParallel(), cp_style, cu, 10 + seed)
    return results


def section_tp_bad_input(platform: Platform, world: int) -> dict[str, Any]:
    from hyperpar_gdn.tensor_parallel.mindspore_styles import (
        AttentionTensorParallel,
        GatedDeltaNetTensorParallel,
    )

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    outcomes: dict[str, Any] = {}

    def expect(name: str, cell: Any, call: Callable[[Any], Any]) -> None:
        before = {n: list(p.shape) for n, p in cell.parameters_and_names()}
        try:
            call(cell)
            outcome = ["no error", ""]
        except Exception as exc:  # recorded and compared, not swallowed
            outcome = [type(exc).__name__, str(exc)]
        unchanged = before == {n: list(p.shape) for n, p in cell.parameters_and_names()}
        outcomes[name] = [*outcome, unchanged]

    expect("gdn_k_heads", gdn(1, 2), lambda c: GatedDeltaNetTensorParallel().apply(c, mesh["tp"]))
    expect("attention_heads", attention(3, 1), lambda c: AttentionTensorParallel().apply(c, mesh["tp"]))
    expect("attention_kv_heads", attention(6, 3), lambda c: AttentionTensorParallel().apply(c, mesh["tp"]))
    expect(
        "after_cp",
        LinearAttentionContextParallel("p2p").apply(gdn(), mesh["cp"]),
        lambda c: GatedDeltaNetTensorParallel().apply(c, mesh["tp"]),
    )
    twice = GatedDeltaNetTensorParallel().apply(gdn(), mesh["tp"])
    expect("twice", twice, lambda c: GatedDeltaNetTensorParallel().apply(c, mesh["tp"]))
    expect("not_1d", gdn(), lambda c: GatedDeltaNetTensorParallel().apply(c, mesh))
    ulysses = GatedDeltaNetTensorParallel().apply(gdn(2, 2), mesh["tp"])  # 1 value head per TP rank
    expect(
        "ulysses_tp_x_cp", ulysses, lambda c: LinearAttentionContextParallel("ulysses").apply(c, mesh["cp"])
    )
    gathered = platform.collectives.all_gather_int(platform.rank(), None)
    outcomes["in_step"] = gathered
    return outcomes


def qwen35_model(moe: bool = False) -> Any:
    """A tiny MindSpore Qwen3.5, dense or MoE (a GDN and an attention layer), the same weights on
    every rank (numpy's seeded init)."""
    from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM, Qwen35Config

    sizes = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    config = Qwen35Config(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        vocab_size=61,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        layer_types=("linear_attention", "full_attention"),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
        **({**sizes, "shared_expert_intermediate_size": 24} if moe else {"intermediate_size": 48}),
    )
    np.random.seed(0)
    return Qwen3_5ForCausalLM(config)


def section_tp_model(platform: Platform, world: int) -> dict[str, Any]:
    """The whole MindSpore Qwen3.5 model (``dense``, ``moe``) under ``apply_tensor_parallel`` (tp
    axis) then ``apply_context_parallel`` (cp axis, p2p, head_tail): the logits shard and every
    parameter gradient (of the sum of the logits' logsumexp; summed over cp, the TP parts put
    together) against the model on one device; and the refusal of a model the plan cannot split."""
    import mindspore as ms
    from mindspore import ops

    from hyperpar_gdn import apply_context_parallel
    from hyperpar_gdn.tensor_parallel.mindspore_apply import apply_tensor_parallel, whole_parameters

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    cp_mesh, tp_mesh = mesh["cp"], mesh["tp"]
    ids = np.random.default_rng(7).integers(0, 61, (2, 16)).astype(np.int64)
    shard = TokenLayout.of("head_tail", [16 // cp_mesh.size()] * cp_mesh.size()).positions(
        cp_mesh.get_local_rank()
    )

    def run(model: Any, inputs: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        names = [name for name, _ in model.parameters_and_names()]

        def loss(x: Any) -> tuple[Any, Any]:
            logits = model(x)
            return ops.logsumexp(logits, -1).sum(), logits

        grad_fn = ms.value_and_grad(loss, None, list(model.get_parameters()), has_aux=True)
        (_, logits), grads = grad_fn(ms.Tensor(inputs))
        return logits.asnumpy(), dict(zip(names, grads, strict=True))

    results: dict[str, Any] = {}
    for moe in (False, True):
        logits_ref, grads_ref = run(qwen35_model(moe), ids)
        model = apply_tensor_parallel(qwen35_model(moe), tp_mesh)
        apply_context_parallel(model, cp_mesh, mode="p2p", layout="head_tail")
        logits, grads = run(model, ids[:, shard])
        summed = {k: platform.collectives.all_reduce_sum(g, cp_mesh.get_group()) for k, g in grads.items()}
        whole = whole_parameters(model, summed, tp_mesh)
        errors = {"logits": relative_error(logits, logits_ref[:, shard])}
        errors.update({k: relative_error(v, grads_ref[k].asnumpy()) for k, v in whole.items()})
        results["moe" if moe else "dense"] = errors
    refused = qwen35_model()
    refused.model.layers[1].self_attn.num_heads = 3  # as a model of 3 query heads would say
    try:
        apply_tensor_parallel(refused, tp_mesh)
        results["refusal"] = ["no error", ""]
    except ValueError as exc:
        results["refusal"] = ["ValueError", str(exc)]
    results["qkv_shape_after_refusal"] = list(refused.model.layers[0].linear_attn.in_proj_qkv.weight.shape)
    return results
