"""The final hidden states and the LM head weight of a torch model the trainer trains.

The trainers compute the loss with :func:`hyperpar_gdn.ops.lm_loss.lm_loss_sum` from these two,
so no rank ever holds its ``[rows, T/cp, V]`` logits. The model's own forward still runs (FSDP2
gathers the root's parameters, the head among them, in its hooks): our ``HybridLM`` returns its
hidden states with ``return_hidden=True``; a transformers model is asked for no logits
(``logits_to_keep`` an empty index) and its text model's ``last_hidden_state`` is read by a
forward hook that is removed again.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar_gdn.distributed.parallelize import text_model_of

__all__ = ["hidden_and_head"]


def hidden_and_head(
    model: torch.nn.Module, input_ids: torch.Tensor, *, transformers: bool, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden ``[B, T, C]`` after the final norm, head weight ``[V, C]``) of ``model`` on
    ``input_ids`` ``[B, T]``; ``cu_seqlens``: packed documents (B = 1) or None."""
    if not transformers:
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        return model(input_ids, return_hidden=True, **packed), model.embed_tokens.weight
    packed = {} if cu_seqlens is None else {"cu_seq_lens_q": cu_seqlens}
    captured: dict[str, torch.Tensor] = {}

    def keep(module: Any, args: Any, output: Any) -> None:
        captured["hidden"] = output.last_hidden_state

    handle = text_model_of(model).register_forward_hook(keep)
    try:
        none = torch.zeros(0, dtype=torch.int64, device=input_ids.device)
        model(input_ids=input_ids, use_cache=False, logits_to_keep=none, **packed)
    finally:
        handle.remove()
    return captured["hidden"], model.get_output_embeddings().weight
