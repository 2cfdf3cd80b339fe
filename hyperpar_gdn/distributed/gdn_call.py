"""What a GDN layer's forward call passes besides the hidden states, and the checks the GDN
style makes on it before any communication (the shard, its length, packed documents)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.parallel_style import refuse_unhandled
from hyperpar_gdn.distributed.sequence import GlobalSequence
from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.plan import HEAD_MODES
from hyperpar_gdn.platform import Tensor


@dataclass(frozen=True)
class CallArgs:
    """What a GDN layer's forward call passes besides the hidden states.

    ``cu_seqlens``: packed documents, int ``[N+1]`` over the WHOLE sequence, the same tensor on
    every rank (by any of the keywords the layer's model family takes it by). ``position_ids``
    (transformers' packed convention) only on one device: a shard's position_ids cannot say
    where the documents of other shards start."""

    attention_mask: Tensor | None
    cu_seqlens: Any
    position_ids: Any


def signature_binder(forward: Callable, *, cu_seqlens_keywords: tuple[str, ...]) -> Callable[..., CallArgs]:
    """Bind a call as the original forward would; refuse every other argument that is set (a
    cache, other packed-sequence keywords: none is handled here). ``cu_seqlens_keywords``: the
    names the layer's family takes the packed documents by (its adapter's), at most one given."""
    signature = inspect.signature(forward)
    owner = getattr(forward, "__self__", forward).__class__.__name__

    def bind(hidden_states: Any, *args: Any, **kwargs: Any) -> CallArgs:
        bound = dict(signature.bind(hidden_states, *args, **kwargs).arguments)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name, {}))
        bound.pop("hidden_states", None)
        given = {k: v for k in cu_seqlens_keywords if (v := bound.pop(k, None)) is not None}
        if len(given) > 1:
            raise ValueError(f"{owner}: pass one of {' or '.join(given)}, not several")
        call = CallArgs(
            attention_mask=bound.pop("attention_mask", None),
            cu_seqlens=next(iter(given.values()), None),
            position_ids=bound.pop("position_ids", None),
        )
        if any(isinstance(v, GlobalSequence) for v in (call.attention_mask, call.cu_seqlens)):
            raise TypeError(
                f"{owner}: the whole sequence's description goes in cp_context=, not in another argument"
            )
        refuse_unhandled(owner, bound)
        return call

    return bind


def packing_error(x: Tensor, cu_seqlens: Any, position_ids: Any) -> str | None:
    """What is wrong with this rank's packed-document keywords under CP, or None."""
    if position_ids is not None:
        return (
            "position_ids (packed documents) cannot be used under context parallelism: a shard's "
            "position_ids do not say where other shards' documents start; pass the global cu_seqlens "
            "(hyperpar_gdn.ops.cu_seqlens_from_position_ids on the whole sequence's position_ids)"
        )
    if cu_seqlens is not None and x.shape[0] != 1:
        return f"packed documents (cu_seqlens) need batch size B=1; got B={x.shape[0]}"
    return None


def shard_error(dims: LayerDims, x: Tensor, attention_mask: Tensor | None) -> str | None:
    """What is wrong with this rank's own input, or None (checked before any communication)."""
    shape = tuple(x.shape)
    if len(shape) != 3 or shape[-1] != dims.hidden_size:
        return f"the local shard must be [B, T/cp, hidden_size={dims.hidden_size}]; got {shape}"
    if attention_mask is not None and tuple(attention_mask.shape) != shape[:2]:
        return f"attention_mask must be this rank's shard [B, T/cp] = {shape[:2]}; got {tuple(attention_mask.shape)}"
    return None


def check_lengths(mode: str, dims: LayerDims, tokens: TokenLayout) -> None:
    """Rules on every rank's token count (every fragment's, for a layout of several per rank);
    the same ValueError on every rank (all know the counts)."""
    halo = dims.conv_kernel_size - 1
    heads = mode in HEAD_MODES  # no halo
    need = 1 if heads else max(halo, 1)
    for rank in range(tokens.size):
        t = min(f.length for f in tokens.mine(rank))
        if t >= need:
            continue
        if heads:
            raise ValueError(
                f"mode={mode!r}: the shard of CP rank {rank} is empty; every shard needs a token"
            )
        raise ValueError(
            f"mode={mode!r}: the shard of CP rank {rank} has "
            + (
                f"T/cp={t} tokens"
                if tokens.is_contiguous
                else f"pieces of {t} tokens (layout={tokens.kind!r})"
            )
            + f", fewer than the conv halo "
            f"W-1={halo} (conv_kernel_size={dims.conv_kernel_size}); every shard needs at least {need}: "
            "use fewer ranks or a longer sequence"
        )
