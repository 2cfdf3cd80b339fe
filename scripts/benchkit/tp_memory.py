"""``bench_tp_memory``'s measurement: one training step of a Qwen3.5-shaped transformers model on
one rank of a TP group (:func:`measure_tp_step`, a rank of :func:`benchkit.ranks.on_ranks`), and
the memory plan's estimate of the same step (:func:`planned`)."""

from __future__ import annotations

import time
from typing import Any

from benchkit.machine import peak_rss_bytes, rss_bytes

__all__ = ["measure_tp_step", "planned", "sizes"]


def sizes(job: dict[str, Any]) -> dict[str, Any]:
    """The model's config fields: Qwen3.5's layout (three GDN layers, then softmax attention) and
    head ratios (value heads twice the q/k heads, K/V heads a quarter of the query heads) at width
    ``job["hidden"]``, ``job["layers"]`` deep, a ``job["vocab"]`` vocabulary (tied head)."""
    hidden = job["hidden"]
    heads = hidden // 128
    return dict(
        vocab_size=job["vocab"],
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=job["layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=128,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=1 << 20,
    )


def planned(job: dict[str, Any], tp: int) -> dict[str, int]:
    """The memory plan's terms (bytes) for one rank of this step at ``tp`` (fp32, no runtime)."""
    from hyperpar_gdn.planning.memory import ModelShape, StepOptions, estimate

    shape = ModelShape.of(sizes(job) | {"model_type": "qwen3_5_text"})
    est = estimate(shape, StepOptions(seq_len=job["seq_len"], tp=tp, world_size=tp, attention="fused"))
    return est.terms | {"total": est.total}


def measure_tp_step(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Build the model, split it over ``world`` TP ranks (none at 1) and put the library's GDN
    layer in (CP over one rank, as ``scripts/train.py`` without ``--cp-size``), then one step: forward with
    the chunked LM loss, backward, AdamW. Returns the parameters this rank holds (bytes; and of
    the decoder layers' matrices), the bytes autograd saved in the forward (distinct storages,
    the parameters' own excluded), the resident memory before the step and its peak."""
    import torch
    import transformers

    from hyperpar_gdn import apply_context_parallel, apply_tensor_parallel, init_device_mesh
    from hyperpar_gdn.integrations.transformers.lm_head import hidden_and_head
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**sizes(job))).train()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("cp", "tp"))
    if world > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_context_parallel(model, mesh["cp"], mode="p2p")  # cp = 1: the library's layer at every tp

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    layers = sum(
        local(p).numel() * local(p).element_size()
        for n, p in model.named_parameters()
        if ".layers." in n and p.dim() > 1
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, job["vocab"], (1, job["seq_len"]), generator=torch.Generator().manual_seed(1))
    owned = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in owned:
            saved[s.data_ptr()] = s.nbytes()
        return t

    before = rss_bytes()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden, head = hidden_and_head(model, ids, transformers=True, cu_seqlens=None)
        loss = lm_loss_sum(hidden, head, ids) / ids.numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return {
        "parameters": params,
        "layer_matrices": layers,
        "saved_activations": sum(saved.values()),
        "rss_before": before,
        "peak": peak_rss_bytes(),
        "seconds": seconds,
        "loss": float(loss.detach()),
    }
