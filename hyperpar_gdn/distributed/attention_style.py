"""Context parallelism for causal softmax attention: all-gather K and V, keep Q local.

Rank r of the CP axis holds tokens ``[r*T/cp, (r+1)*T/cp)``. It projects its queries, keys and
values with RoPE at those global positions, all-gathers the keys and values of the whole
sequence (differentiable: the gradient is reduce-scattered back to each shard's owner) and runs
causal attention of its queries over keys ``0 .. (r+1)*T/cp - 1`` (later shards are invisible to
it, so they are dropped before the matmuls). The result equals the single-device layer's rows.

The algorithm is written once (:func:`attention_forward`); per layer class a small adapter says
how the layer projects its shard and finishes the output:

- :class:`OwnAttention`: ``hyperpar_gdn``'s ``CausalSelfAttention`` (torch and MindSpore), which
  computes RoPE itself from the shard's position offset;
- :class:`TransformersAttention`: transformers' ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention``,
  which take the cos/sin that the model computed from the shard's global ``position_ids``.

Traffic per rank and forward: ``2 * B * Hkv * T/cp * D * (cp-1)`` elements (as much again in the
backward). Work is unbalanced (the last rank attends over the whole sequence); fine for the
1-in-4 softmax layers of a hybrid model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.ops.attention import causal_attention, finish_attention, project_attention
from hyperpar_gdn.platform import Tensor, ops_for

from .mesh import DeviceMesh, as_cp_mesh
from .style import ParallelStyle, refuse_unhandled

TRANSFORMERS_ATTENTION = ("Qwen3_5Attention", "Qwen3_5MoeAttention")


@dataclass(frozen=True)
class GlobalKeyMask:
    """The padding mask of the whole sequence, ``[B, T]`` (1 = token, 0 = padding), gathered once
    per model forward and handed to every attention layer in place of transformers' local mask."""

    mask: Tensor


class OwnAttention:
    """Adapter for ``hyperpar_gdn.models.attention.CausalSelfAttention`` and its MindSpore twin."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def project(self, x_BTC: Tensor, *, position_offset: int, cos_sin: Any = None) -> tuple[Tensor, ...]:
        return self.module.project(x_BTC, position_offset=position_offset)

    def finish(self, o_BTX: Tensor, gate_BTX: Tensor) -> Tensor:
        return self.module.finish(o_BTX, gate_BTX)


class TransformersAttention:
    """Adapter for transformers' Qwen3.5 full-attention layers: the layer's own ``q_proj`` (query
    and output gate), ``q_norm``, ``k_proj``, ``k_norm``, ``v_proj`` and ``o_proj``; RoPE from the
    ``position_embeddings`` (cos, sin ``[B, T/cp, R]``) the model passes."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def project(self, x_BTC: Tensor, *, position_offset: int, cos_sin: Any = None) -> tuple[Tensor, ...]:
        m, t = self.module, x_BTC.shape[1]
        cos, sin = cos_sin
        return project_attention(
            ops_for(x_BTC),
            x_BTC,
            head_dim=m.head_dim,
            q_proj=m.q_proj,
            k_proj=m.k_proj,
            v_proj=m.v_proj,
            q_norm=m.q_norm,
            k_norm=m.k_norm,
            cos=cos.reshape(cos.shape[0], 1, t, -1),
            sin=sin.reshape(sin.shape[0], 1, t, -1),
        )

    def finish(self, o_BTX: Tensor, gate_BTX: Tensor) -> Tensor:
        return finish_attention(ops_for(o_BTX), o_BTX, gate_BTX, self.module.o_proj)


def attention_forward(
    adapter: Any,
    mesh: DeviceMesh,
    x_BTC: Tensor,
    *,
    cos_sin: Any = None,
    key_mask: GlobalKeyMask | None = None,
) -> Tensor:
    """x ``[B, T/cp, hidden]`` (this rank's shard) -> ``[B, T/cp, hidden]``."""
    cp, rank = mesh.size(), mesh.get_local_rank()
    b, t_local, _ = x_BTC.shape
    offset = rank * t_local
    xp = mesh.platform.ops
    q_BHTD, k_BHTD, v_BHTD, gate = adapter.project(x_BTC, position_offset=offset, cos_sin=cos_sin)
    mask = None if key_mask is None else key_mask.mask[:, : (rank + 1) * t_local]
    if cp > 1:
        hkv, d = k_BHTD.shape[1], k_BHTD.shape[3]
        kv_BHTD = xp.cat([k_BHTD, v_BHTD], 1)  # [B, 2Hkv, T/cp, D]
        gathered = mesh.platform.collectives.all_gather(kv_BHTD, mesh.get_group())  # [cp, B, 2Hkv, T/cp, D]
        visible = xp.permute(gathered[: rank + 1], (1, 2, 0, 3, 4)).reshape(b, 2 * hkv, -1, d)
        k_BHTD, v_BHTD = visible[:, :hkv], visible[:, hkv:]
    o_BTX = causal_attention(xp, q_BHTD, k_BHTD, v_BHTD, q_offset=offset, key_mask=mask)
    return adapter.finish(o_BTX, gate)


class SoftmaxAttentionContextParallel(ParallelStyle):
    """Context parallelism for causal softmax attention layers: ours
    (:class:`~hyperpar_gdn.models.attention.CausalSelfAttention`, torch, and its MindSpore twin)
    and transformers' ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention``. One implementation over the
    mesh's platform (its TensorOps and differentiable all-gather).

    After ``apply(module, mesh)`` the module's forward takes and returns this rank's shard
    ``[B, T/cp, hidden]`` (every rank the same T/cp) and gives exactly the single-device rows.
    Parameters are untouched; their gradients are this rank's share (sum them over the CP ranks).
    ``undo(module)`` restores the original forward.

    transformers' layers keep their call signature ``(hidden_states, position_embeddings,
    attention_mask, ...)`` and return ``(output, None)``; ``position_embeddings`` must be the
    cos/sin of the shard's global positions, and ``attention_mask`` None or the
    :class:`GlobalKeyMask` that ``apply_context_parallel`` passes for a whole transformers model
    (a local 4-D mask cannot describe the keys of other ranks, so it is refused).

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        SoftmaxAttentionContextParallel().apply(attn, mesh)
        y_local = attn(x_local)        # x_local: [B, T/2, hidden]
    """

    def apply(self, module: Any, mesh: Any) -> Any:
        cp_mesh = as_cp_mesh(mesh)
        if type(module).__name__ in TRANSFORMERS_ATTENTION:
            return self._install(module, lambda original: _transformers_forward(module, cp_mesh))
        for name in ("project", "attend", "finish"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} has no {name}(): SoftmaxAttentionContextParallel supports "
                    f"hyperpar_gdn.models.attention.CausalSelfAttention and transformers' "
                    f"{' / '.join(TRANSFORMERS_ATTENTION)}"
                )
        adapter = OwnAttention(module)

        def forward(hidden_states: Tensor) -> Tensor:
            _check_shard(hidden_states, module.hidden_size)
            return attention_forward(adapter, cp_mesh, hidden_states)

        return self._install(module, lambda original: forward)


def _transformers_forward(module: Any, mesh: DeviceMesh) -> Any:
    adapter = TransformersAttention(module)
    hidden_size = module.config.hidden_size

    def forward(
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        refuse_unhandled(type(module).__name__, {"cache": cache, **kwargs}, allowed=("position_ids",))
        if module.training and module.attention_dropout:
            raise NotImplementedError(
                f"{type(module).__name__}: attention_dropout={module.attention_dropout} is not supported "
                "under context parallelism; set config.attention_dropout = 0"
            )
        if attention_mask is not None and not isinstance(attention_mask, GlobalKeyMask):
            raise NotImplementedError(
                f"{type(module).__name__} under context parallelism got a local attention_mask of shape "
                f"{tuple(attention_mask.shape)}; pass the 2-D padding mask to the whole model, which "
                "apply_context_parallel(model, ...) gathers for its attention layers"
            )
        _check_shard(hidden_states, hidden_size)
        out = attention_forward(
            adapter, mesh, hidden_states, cos_sin=position_embeddings, key_mask=attention_mask
        )
        return out, None

    return forward


def _check_shard(x_BTC: Tensor, hidden_size: int) -> None:
    shape = tuple(x_BTC.shape)
    if len(shape) != 3 or shape[-1] != hidden_size:
        raise ValueError(f"the local shard must be [B, T/cp, hidden_size={hidden_size}]; got {shape}")
