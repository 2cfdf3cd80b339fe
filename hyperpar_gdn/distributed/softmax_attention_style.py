"""The parallel style for causal softmax attention layers: :class:`SoftmaxAttentionContextParallel`.

The algorithm (all-gathered K and V, local queries at their global positions, the head_tail
layout) is :mod:`.softmax_attention`; this file installs it on a layer: ours
(``hyperpar_gdn``'s ``CausalSelfAttention``, torch and MindSpore, through :class:`OwnAttention`)
or transformers' ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention``
(:mod:`hyperpar_gdn.integrations.transformers.attention`).
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.distributed.dtensor import as_sequence_shard
from hyperpar_gdn.distributed.layout import check_layout
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle, from_transformers
from hyperpar_gdn.distributed.sequence import GlobalSequence
from hyperpar_gdn.distributed.softmax_attention import attention_forward, call_sequence
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor


class OwnAttention:
    """Adapter for ``hyperpar_gdn.models.attention.CausalSelfAttention`` and its MindSpore twin."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def project(self, x_BTC: Tensor, *, position_offset: int, cos_sin: Any = None) -> tuple[Tensor, ...]:
        return self.module.project(x_BTC, position_offset=position_offset)

    def finish(self, o_BTX: Tensor, gate_BTX: Tensor) -> Tensor:
        return self.module.finish(o_BTX, gate_BTX)


class SoftmaxAttentionContextParallel(ParallelStyle):
    """Context parallelism for causal softmax attention layers: ours
    (:class:`~hyperpar_gdn.models.attention.CausalSelfAttention`, torch, and its MindSpore twin)
    and transformers' ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention``. One implementation over the
    mesh's platform (its TensorOps and differentiable all-gather).

    After ``apply(module, mesh)`` the module's forward takes and returns this rank's shard
    ``[B, T_r, hidden]`` (shards may differ in length) and gives exactly the single-device rows;
    ours also take ``cu_seqlens=`` (packed documents: the whole sequence's boundaries). Both take
    ``prefill_states=`` (an inference prefill's record: handed K and V of the whole sequence in
    global order, on every rank) and ``cp_context=``, the whole model's per-forward
    :class:`~hyperpar_gdn.distributed.sequence.GlobalSequence`; without it a layer describes its
    own call (its shard lengths exchanged, its documents), as the GDN style does.
    Parameters are untouched; their gradients are this rank's share (sum them over the CP ranks:
    :func:`~hyperpar_gdn.sync_context_parallel_grads`).
    ``undo(module)`` restores the original forward.

    transformers' layers keep their call signature ``(hidden_states, position_embeddings,
    attention_mask, ...)`` and return ``(output, None)``; ``position_embeddings`` must be the
    cos/sin of the shard's positions; the padding comes in ``cp_context`` (a local 4-D
    ``attention_mask`` cannot describe the keys of other ranks, so it is refused).

    ``layout``: ``"contiguous"`` or ``"head_tail"`` (:mod:`hyperpar_gdn.distributed.layout`),
    which tokens a rank holds.

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        SoftmaxAttentionContextParallel().apply(attn, mesh)
        y_local = attn(x_local)        # x_local: [B, T/2, hidden]
    """

    def __init__(self, *, layout: str = "contiguous") -> None:
        self.layout = check_layout(layout)

    def apply(self, module: Any, mesh: Any) -> Any:
        """Make ``module``'s forward take and return this rank's shard; returns ``module``."""
        error = self.error(module)
        if error is not None:
            raise TypeError(error)
        return self.install(module, as_cp_mesh(mesh))

    @staticmethod
    def error(module: Any) -> str | None:
        """Why this style cannot serve ``module``, or None."""
        if from_transformers(module):
            return None
        missing = [name for name in ("project", "finish") if not callable(getattr(module, name, None))]
        if missing:
            return (
                f"{type(module).__name__} has no {missing[0]}(): SoftmaxAttentionContextParallel supports "
                "hyperpar_gdn.models.attention.CausalSelfAttention and transformers' Qwen3.5 attention"
            )
        return None

    def install(self, module: Any, cp_mesh: Any) -> Any:
        """Install the CP forward on ``module`` (checked by :meth:`apply` or
        :func:`~hyperpar_gdn.apply_context_parallel`)."""
        if from_transformers(module):
            from hyperpar_gdn.integrations.transformers.attention import transformers_attention_forward

            return self._install(
                module,
                lambda original: transformers_attention_forward(module, cp_mesh, self.layout),
                layout=self.layout,
            )
        adapter = OwnAttention(module)

        def forward(
            hidden_states: Any,
            *,
            cu_seqlens: Any = None,
            prefill_states: PrefillStates | None = None,
            cp_context: GlobalSequence | None = None,
        ) -> Any:
            x_BTC, wrap = as_sequence_shard(hidden_states, owner=type(self).__name__, layout=self.layout)
            seq = call_sequence(
                cp_mesh, self.layout, x_BTC, module.hidden_size, cp_context=cp_context, cu_seqlens=cu_seqlens
            )
            return wrap(attention_forward(adapter, cp_mesh, x_BTC, seq, prefill_states=prefill_states))

        return self._install(module, lambda original: forward, layout=self.layout)
