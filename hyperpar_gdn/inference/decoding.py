"""Decoding for this package's language models: the state after a prompt, one greedy step, and
greedy generation, written once for ``HybridLM`` (torch and MindSpore) and the MindSpore
``Qwen3_5ForCausalLM``.

The decoding state (:class:`DecodingState`) holds, per block, the GDN layer's conv state
``[B, C, W]`` and recurrent state ``[B, H, K, V]``, or the attention layer's K and V
``[B, Hkv, T, D]`` (:mod:`hyperpar_gdn.ops.prefill_states`), and the number of tokens read. A
prompt's state comes from one forward of the prompt (:func:`prefill` on one device, or
``hyperpar_gdn.prefill_context_parallel`` under context parallelism); :func:`decode_step` then
reads one token per row and :func:`greedy_continue` picks the argmax token step by step.

Supported: prompts without padding (these models take no attention mask), every row of the batch
the same length; no sampling here (``scripts/generate.py`` samples from the returned logits).

Legend: B batch, T tokens, C hidden size (conv channels in a conv state), V vocabulary, W conv
width, H value heads, K/V head dims, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.ops.attention.softmax import causal_attention
from hyperpar_gdn.ops.blocks import decoder_block, lm_logits
from hyperpar_gdn.ops.gdn.decode import gdn_decode_step
from hyperpar_gdn.ops.gdn.kernels import platform_of, resolve_kernel
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor, ops_for

__all__ = [
    "DecodingState",
    "LMParts",
    "decode_step",
    "greedy_continue",
    "greedy_generate",
    "greedy_tokens",
    "lm_parts",
    "prefill",
    "state_from_prefill",
    "step_blocks",
]


@dataclass(frozen=True)
class DecodingState:
    """Attributes:
    layers: per block, ``(conv [B, C, W], S [B, H, K, V])`` for a GDN block, ``(K, V)`` each
        ``[B, Hkv, length, D]`` (normed and rotated keys) for a softmax attention block.
    length: tokens read so far; the next token sits at this position.
    """

    layers: tuple[tuple[Tensor, Tensor], ...]
    length: int


@dataclass(frozen=True)
class LMParts:
    """Where one of our LMs keeps its parts: ``embed(ids [B, T]) -> [B, T, C]``, the decoder
    ``blocks``, the final ``norm`` and the LM head weight ``head`` ``[V, C]``."""

    embed: Callable[[Tensor], Tensor]
    blocks: Sequence[Any]
    norm: Callable[[Tensor], Tensor]
    head: Tensor


def lm_parts(model: Any) -> LMParts:
    """The parts of ``HybridLM`` (torch or MindSpore) or the MindSpore ``Qwen3_5ForCausalLM``."""
    if hasattr(model, "head_weight") and hasattr(model, "model"):  # MindSpore Qwen3_5ForCausalLM
        inner = model.model
        return LMParts(inner.embed_tokens, inner.layers, inner.norm, model.head_weight)
    if all(hasattr(model, name) for name in ("embed_tokens", "layers", "norm")):  # HybridLM
        return LMParts(model.embed_tokens, model.layers, model.norm, model.embed_tokens.weight)
    raise TypeError(
        f"{type(model).__name__} is not one of this package's LMs (HybridLM, or the MindSpore "
        "Qwen3_5ForCausalLM); for transformers' models use their own cache and generate()"
    )


def inference_mode(model: Any) -> contextlib.AbstractContextManager:
    """No gradient recording while a prompt or a step runs: ``torch.no_grad()`` for a torch
    module; MindSpore records none outside ``grad``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return torch.no_grad()
    return contextlib.nullcontext()


def last_hidden(parts: LMParts, input_ids: Tensor, states: PrefillStates) -> Tensor:
    """The final-normed hidden states ``[B, T, C]`` of a prompt (of a shard under context
    parallelism); every mixer is handed ``states`` and records its decoding state in it."""
    x_BTC = parts.embed(input_ids)
    for block in parts.blocks:
        x_BTC = decoder_block(
            x_BTC,
            mixer=lambda h, mixer=block.mixer: mixer(h, prefill_states=states),
            mlp=block.mlp,
            input_norm=block.input_layernorm,
            post_norm=block.post_attention_layernorm,
        )
    return parts.norm(x_BTC)


def state_from_prefill(model: Any, states: PrefillStates, length: int) -> DecodingState:
    """The :class:`DecodingState` of ``model`` from the states its mixers recorded over a prompt
    of ``length`` tokens."""
    layers = []
    for i, block in enumerate(lm_parts(model).blocks):
        mixer = block.mixer
        found = (states.gdn if block.layer_type == "linear_attention" else states.kv).get(id(mixer))
        if found is None:
            raise RuntimeError(f"block {i} ({block.layer_type}) recorded no state during the prompt")
        layers.append(found)
    return DecodingState(layers=tuple(layers), length=length)


def prefill(model: Any, input_ids: Tensor) -> tuple[Tensor, DecodingState]:
    """Read a prompt ``[B, T]`` on one device -> (logits of its last token ``[B, V]``, the state).

    Example:
        >>> logits, state = prefill(model, prompt_ids)
        >>> new_tokens = greedy_continue(model, logits, state, max_new_tokens=16)   # [B, 16]
    """
    check_prompt(input_ids)
    parts = lm_parts(model)
    states = PrefillStates()
    with inference_mode(model):
        hidden = last_hidden(parts, input_ids, states)
        t = hidden.shape[1]
        logits = lm_logits(ops_for(hidden), hidden[:, t - 1 :], parts.head)
    return logits[:, 0], state_from_prefill(model, states, int(input_ids.shape[1]))


def decode_step(
    model: Any, state: DecodingState, ids_B1: Tensor, *, gdn_kernel: str = "auto"
) -> tuple[Tensor, DecodingState]:
    """One token per row ``[B, 1]`` at position ``state.length`` -> (its logits ``[B, V]``, the
    state after it). ``gdn_kernel``: the GDN layers' step, ``"auto"``, ``"fla"`` (fla's fused
    recurrent kernel) or ``"native"`` (:func:`~hyperpar_gdn.ops.gdn.kernels.resolve_kernel`)."""
    check_step_ids(ids_B1)
    blocks = lm_parts(model).blocks
    if len(state.layers) != len(blocks):
        raise ValueError(f"the state has {len(state.layers)} layers; the model has {len(blocks)} blocks")
    kv = {}

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        xp = ops_for(q)
        first, second = state.layers[i]
        kv[i] = (xp.cat([first, k], 2), xp.cat([second, v], 2))
        return causal_attention(xp, q, *kv[i], q_offset=state.length)

    gdn = {i: pair for i, pair in enumerate(state.layers) if blocks[i].layer_type == "linear_attention"}
    logits, gdn = step_blocks(
        model, ids_B1, position=state.length, gdn=gdn, attend=attend, gdn_kernel=gdn_kernel
    )
    layers = tuple(gdn[i] if i in gdn else kv[i] for i in range(len(blocks)))
    return logits, DecodingState(layers=layers, length=state.length + 1)


def step_blocks(
    model: Any,
    ids_B1: Tensor,
    *,
    position: int,
    gdn: Mapping[int, tuple[Tensor, Tensor]],
    attend: Callable[[int, Tensor, Tensor, Tensor], Tensor],
    gdn_kernel: str = "auto",
) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
    """One token per row ``[B, 1]`` at ``position`` through one of our LMs: GDN block i steps
    from ``gdn[i]`` (conv ``[B, C, W]``, S ``[B, H, K, V]``); attention block i projects the
    token and ``attend(i, q [B, H, 1, D], k [B, Hkv, 1, D], v)`` returns its output
    ``[B, 1, H*D]`` (and keeps k and v where the caller's cache lives) -> (logits ``[B, V]``,
    the GDN states after the token). ``gdn_kernel``: as in :func:`decode_step`."""
    parts = lm_parts(model)
    new_gdn = {}
    with inference_mode(model):
        x = parts.embed(ids_B1)
        xp = ops_for(x)
        kernel = resolve_kernel(gdn_kernel, platform=platform_of(x)).name
        for i, block in enumerate(parts.blocks):
            h = block.input_layernorm(x)
            mixer = block.mixer
            if block.layer_type == "linear_attention":
                out, conv, s = gdn_decode_step(
                    xp, LayerWeights.of(mixer), LayerDims.of(mixer), h, *gdn[i], kernel=kernel
                )
                new_gdn[i] = (conv, s)
            else:
                q, k, v, gate = mixer.project(h, position_offset=position)
                out = mixer.finish(attend(i, q, k, v), gate)
            x = x + _summed_over_tp(mixer, out)
            x = x + block.mlp(block.post_attention_layernorm(x))
        logits = lm_logits(xp, parts.norm(x), parts.head)
    return logits[:, 0], new_gdn


def _summed_over_tp(mixer: Any, out: Tensor) -> Tensor:
    """A tensor-parallel mixer's share of the output ``[B, 1, hidden]`` summed over its TP group
    (its parts were called here, not through the module and its hooks); others' as they are."""
    shard = head_shard_of(mixer)
    return out if shard is None else shard.reduce(out)


def greedy_continue(
    model: Any, logits_BV: Tensor, state: DecodingState, *, max_new_tokens: int, gdn_kernel: str = "auto"
) -> Tensor:
    """Greedy continuation from the logits of the last token read and the state after it ->
    the ``max_new_tokens`` new tokens ``[B, N]`` (int64, on the logits' device); ``gdn_kernel`` as
    in :func:`decode_step`."""
    current = [state]

    def step(ids_B1: Tensor) -> Tensor:
        logits, current[0] = decode_step(model, current[0], ids_B1, gdn_kernel=gdn_kernel)
        return logits

    return greedy_tokens(logits_BV, step, max_new_tokens=max_new_tokens)


def greedy_tokens(logits_BV: Tensor, step: Callable[[Tensor], Tensor], *, max_new_tokens: int) -> Tensor:
    """The argmax token of ``logits_BV`` ``[B, V]``, then of ``step(token [B, 1])``'s logits, ...
    -> the ``max_new_tokens`` tokens ``[B, N]`` (int64, on the logits' device); ``step`` is called
    ``max_new_tokens - 1`` times."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
    xp = ops_for(logits_BV)
    like = xp.arange(1, like=logits_BV)  # int64 on the logits' device
    tokens = []
    for i in range(max_new_tokens):
        next_ids = np.argmax(xp.to_numpy(logits_BV), -1).reshape(-1, 1)
        tokens.append(next_ids)
        if i + 1 < max_new_tokens:
            logits_BV = step(xp.constant(next_ids, like=like))
    return xp.constant(np.concatenate(tokens, 1), like=like)


def greedy_generate(model: Any, input_ids: Tensor, *, max_new_tokens: int) -> Tensor:
    """The prompt ``[B, T]`` followed by its greedy continuation: ``[B, T + max_new_tokens]``,
    as transformers' ``generate(do_sample=False)`` returns it."""
    logits, state = prefill(model, input_ids)
    new = greedy_continue(model, logits, state, max_new_tokens=max_new_tokens)
    xp = ops_for(new)
    return xp.cat([xp.cast(input_ids, xp.dtype(new)), new], 1)


def check_step_ids(ids_B1: Tensor) -> None:
    if len(ids_B1.shape) != 2 or ids_B1.shape[1] != 1:
        raise ValueError(f"a decoding step takes one token per row, [B, 1]; got shape {tuple(ids_B1.shape)}")


def check_prompt(input_ids: Tensor) -> None:
    shape = tuple(input_ids.shape)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"the prompt must be input_ids [B, T] with T >= 1; got shape {shape}")
