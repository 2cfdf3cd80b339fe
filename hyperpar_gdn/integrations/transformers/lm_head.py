"""The final hidden states and the LM head weight of a torch model the trainer trains.

The trainers compute the loss with :func:`hyperpar_gdn.ops.lm_loss.lm_loss_sum` from these two,
so no rank ever holds its ``[rows, T/cp, V]`` logits. The model's own forward still runs (FSDP2
gathers the root's parameters, the head among them, in its hooks): our ``HybridLM`` returns its
hidden states with ``return_hidden=True``; on a transformers model a forward pre-hook hands its
``lm_head`` no tokens (``[B, 0, C]``) and a forward hook reads the text model's
``last_hidden_state``; both are removed again.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar_gdn.distributed.decoder_layers import text_model_of

__all__ = ["hidden_and_head", "transformers_hidden_and_head"]


def hidden_and_head(
    model: torch.nn.Module, input_ids: torch.Tensor, *, transformers: bool, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden ``[B, T, C]`` after the final norm, head weight ``[V, C]``) of ``model`` on
    ``input_ids`` ``[B, T]``; ``cu_seqlens``: packed documents (B = 1) or None."""
    if not transformers:
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        return model(input_ids, return_hidden=True, **packed), model.embed_tokens.weight
    packed = {} if cu_seqlens is None else {"cu_seq_lens_q": cu_seqlens}
    return transformers_hidden_and_head(model, model, {"input_ids": input_ids, **packed})


def transformers_hidden_and_head(
    model: torch.nn.Module, unwrapped: torch.nn.Module, inputs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states ``[B, T, C]``, head weight ``[V, C]``) from one call
    ``model(**inputs, use_cache=False)`` of a transformers causal LM. ``model`` may be a wrapper
    of ``unwrapped`` (DDP, FSDP: its hooks run); the hooks go on ``unwrapped``'s text model and
    head, and are removed again whatever happens."""
    captured: dict[str, torch.Tensor] = {}

    def keep(module: Any, args: Any, output: Any) -> None:
        captured["hidden"] = output.last_hidden_state

    def no_tokens(module: Any, args: tuple) -> tuple:
        return (args[0][:, :0],)  # the head multiplies no token: [B, 0, V] logits

    head = unwrapped.get_output_embeddings()
    handles = [text_model_of(unwrapped).register_forward_hook(keep)]
    try:
        handles.append(head.register_forward_pre_hook(no_tokens))
        model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured["hidden"], head.weight
