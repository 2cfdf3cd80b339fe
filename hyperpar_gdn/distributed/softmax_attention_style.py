"""The parallel style for causal softmax attention layers: :class:`SoftmaxAttentionContextParallel`.

The algorithm (all-gathered K and V, local queries at their global positions, the head_tail
layout) is :mod:`.softmax_attention`; this file installs on a layer the forward that the layer's
model adapter makes of it (:mod:`.adapters`): ours (``hyperpar_gdn``'s ``CausalSelfAttention``,
torch and MindSpore, :class:`~.decoder_layers.DecoderAdapter`) or transformers'
``Qwen3_5Attention`` / ``Qwen3_5MoeAttention`` (:mod:`hyperpar_gdn.integrations.transformers.adapter`).
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.distributed.decoder_layers import layer_adapter_for
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle
from hyperpar_gdn.planning.plan import check_layout


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
        return self.install(module, as_cp_mesh(mesh))

    @staticmethod
    def error(module: Any) -> str | None:
        """Why this style cannot serve ``module`` (no model adapter serves it), or None."""
        try:
            layer_adapter_for(module)
        except TypeError as error:
            return str(error)
        return None

    def install(self, module: Any, cp_mesh: Any) -> Any:
        """Install the CP forward of ``module``'s model adapter
        (:func:`~hyperpar_gdn.distributed.decoder_layers.layer_adapter_for`) on it."""
        adapter = layer_adapter_for(module)
        return self._install(
            module,
            lambda original: adapter.attention_forward(module, cp_mesh, self.layout),
            layout=self.layout,
        )
