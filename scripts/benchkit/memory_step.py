"""``bench_memory``'s measurements: one whole training step of a random transformers Qwen3.5 model
with Qwen3.5's 248,320-token vocabulary under CP (:func:`measure_step`), and the LM loss alone
(:func:`measure_loss`), each on ranks of :func:`benchkit.ranks.on_ranks` (fresh processes, so a
step's peak is not hidden by an earlier one)."""

from __future__ import annotations

import time
from typing import Any

from benchkit.machine import peak_rss_bytes, rss_bytes

__all__ = ["VOCAB", "build_model", "measure_loss", "measure_step", "qwen35_sizes"]

VOCAB = 248_320


def qwen35_sizes(hidden: int, layers: int, *, experts: int = 0) -> dict[str, Any]:
    """The config fields of the benchmark's Qwen3.5 model: the 248,320-token vocabulary (tied
    head), ``hidden`` wide (a multiple of 64), ``layers`` deep (every 4th softmax attention); with
    ``experts`` > 0 a Qwen3.5-MoE with 2 experts per token and a shared expert."""
    heads = max(1, hidden // 64)
    sizes: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=True,
    )
    if experts:
        sizes.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=hidden)
        sizes.update(shared_expert_intermediate_size=hidden)
    else:
        sizes.update(intermediate_size=3 * hidden)
    return sizes


def build_model(hidden: int, layers: int) -> Any:
    """A random transformers Qwen3.5 text model of :func:`qwen35_sizes`."""
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(**qwen35_sizes(hidden, layers))
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config)


def measure_step(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank (of :func:`benchkit.ranks.on_ranks`): build, then time ``job["steps"]`` training
    steps; the resident memory before, the peak, its growth and the seconds of each step."""
    import torch
    import torch.nn.functional as F

    from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
    from hyperpar_gdn.integrations.transformers.lm_head import hidden_and_head
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum
    from hyperpar_gdn.parallel.checkpointing import apply_activation_checkpointing
    from hyperpar_gdn.platform import get_platform

    platform = get_platform("cpu")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = build_model(job["hidden"], job["layers"]).train()
    apply_context_parallel(model, mesh, mode="p2p")
    if job["ac"]:
        apply_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (1, job["seq_len"]), generator=torch.Generator().manual_seed(1))
    shard = shard_for_context_parallel(mesh, ids)
    count = float((ids[:, 1:] >= 0).sum())
    bf16 = job["dtype"] == "bf16"

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if job["loss"] == "chunked":
                hidden, head = hidden_and_head(model, shard.input_ids, transformers=True, cu_seqlens=None)
        if job["loss"] == "chunked":
            loss_sum = lm_loss_sum(hidden.to(torch.bfloat16) if bf16 else hidden, head, shard.labels)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=shard.input_ids, use_cache=False).logits
            loss_sum = F.cross_entropy(
                logits.float().reshape(-1, VOCAB), shard.labels.reshape(-1), reduction="sum"
            )
        (loss_sum / count).backward()
        for p in model.parameters():  # the CP group's gradient shares add up
            platform.collectives.all_reduce_sum(p.grad, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.detach())

    before = rss_bytes()
    times = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = peak_rss_bytes()
    return {"rss_before": before, "peak": peak, "growth": peak - before, "seconds": times}


def measure_loss(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """The loss alone (one rank): forward and backward from fixed hidden states ``[1, T, C]`` and
    head ``[V, C]``; the peak growth, the seconds and the loss."""
    import torch
    import torch.nn.functional as F

    from hyperpar_gdn.ops.lm_loss import lm_loss_sum

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, job["seq_len"], job["hidden"], generator=gen).requires_grad_()
    head = (0.02 * torch.randn(VOCAB, job["hidden"], generator=gen)).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, job["seq_len"]), generator=gen)
    before = rss_bytes()
    start = time.perf_counter()
    if job["loss"] == "chunked":
        loss = lm_loss_sum(hidden, head, labels)
    else:
        loss = F.cross_entropy((hidden @ head.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    loss.backward()
    seconds = time.perf_counter() - start
    return {"growth": peak_rss_bytes() - before, "seconds": [seconds], "loss": float(loss.detach())}
