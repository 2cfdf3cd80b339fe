"""transformers' Qwen3.5 full-attention layers under :class:`SoftmaxAttentionContextParallel`.

The algorithm is the core's (:func:`~hyperpar_gdn.distributed.softmax_attention_style.attention_forward`);
this adapter says how ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention`` project a shard (their own
``q_proj`` with the output gate, ``q_norm``/``k_norm``, RoPE from the cos/sin the model computed
from the shard's global ``position_ids``) and finish it (gate, ``o_proj``).
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallel_style import refuse_unhandled
from hyperpar_gdn.distributed.sequence import GlobalSequence
from hyperpar_gdn.distributed.softmax_attention import attention_forward, call_sequence
from hyperpar_gdn.ops.attention.softmax import finish_attention, project_attention
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor, ops_for

__all__ = ["TransformersAttention", "transformers_attention_forward"]


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


def transformers_attention_forward(module: Any, mesh: DeviceMesh, layout: str) -> Any:
    """The CP forward of a transformers Qwen3.5 attention layer. The whole sequence's description
    comes as ``cp_context=``, which the model's forward pre-hook adds to the keywords its decoder
    layers pass on; a layer called without it describes its own call (its documents from
    ``cu_seq_lens_q``)."""
    adapter = TransformersAttention(module)
    hidden_size = module.config.hidden_size

    def forward(
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Any = None,
        cache: Any = None,
        prefill_states: PrefillStates | None = None,
        cp_context: GlobalSequence | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        # position_ids: RoPE came with position_embeddings; cu_seq_lens_q: the documents
        refuse_unhandled(
            type(module).__name__, {"cache": cache, **kwargs}, allowed=("position_ids", "cu_seq_lens_q")
        )
        if module.training and module.attention_dropout:
            raise NotImplementedError(
                f"{type(module).__name__}: attention_dropout={module.attention_dropout} is not supported "
                "under context parallelism; set config.attention_dropout = 0"
            )
        if attention_mask is not None:
            raise NotImplementedError(
                f"{type(module).__name__} under context parallelism takes the padding from the model's "
                f"per-forward context (cp_context=), not attention_mask= (got {type(attention_mask).__name__}): "
                "a mask of this rank's shard cannot describe the keys of the others"
            )
        seq = call_sequence(
            mesh,
            layout,
            hidden_states,
            hidden_size,
            cp_context=cp_context,
            cu_seqlens=kwargs.get("cu_seq_lens_q"),
        )
        return attention_forward(
            adapter,
            mesh,
            hidden_states,
            seq,
            cos_sin=position_embeddings,
            prefill_states=prefill_states,
        ), None

    return forward
