"""The framework-free half of the mixer layers that the torch and MindSpore models share.

A layer class of either framework is ``class GatedDeltaNet(GatedDeltaNetShell, nn.Module)``: the
shell holds the constructor (its arguments, their checks, the dimension attributes and the order
in which parameters are made), the forward and their docstrings, written once; the framework's
class says only how it makes a parameter (``_linear``, ``_causal_conv``, ...). The maths is in
:mod:`hyperpar_gdn.ops` (:func:`~hyperpar_gdn.ops.gdn.layer.layer_forward`,
:mod:`hyperpar_gdn.ops.attention.softmax`).

Parameters keep transformers' names and shapes, so weights copy over one to one::

    GDN:        in_proj_qkv.weight [C, hidden]   in_proj_z.weight [H*Dv, hidden]
                in_proj_b.weight [H, hidden]     in_proj_a.weight [H, hidden]
                conv1d.weight [C, 1, W]          A_log [H]   dt_bias [H]
                norm.weight [Dv]                 out_proj.weight [hidden, H*Dv]
    attention:  q_proj.weight [2*H*D, hidden] (query and output gate)
                k_proj.weight, v_proj.weight [Hkv*D, hidden]   o_proj.weight [hidden, H*D]
                q_norm.weight, k_norm.weight [D]

with C = 2*Hk*Dk + H*Dv. Legend: B batch, T tokens, H heads, D head dim.
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.models.config import LINEAR, check_layer_type
from hyperpar_gdn.ops.attention.softmax import causal_attention, init_attention_dims
from hyperpar_gdn.ops.blocks import decoder_block, swiglu_of
from hyperpar_gdn.ops.gdn.layer import init_layer_dims, layer_forward
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.ops.projections import projection
from hyperpar_gdn.platform import ops_for

__all__ = ["AttentionShell", "DecoderBlockShell", "GatedDeltaNetShell", "MLPShell"]


class GatedDeltaNetShell:
    """Qwen3.5 GDN layer; state dicts load both ways with transformers' ``Qwen3_5GatedDeltaNet``.

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: query/key heads and value heads (num_v_heads a multiple).
        head_k_dim, head_v_dim: per-head dims.
        conv_kernel_size: width W of the causal depthwise conv.
        norm_eps: epsilon of the gated RMSNorm.

    forward(hidden_states ``[B, T, hidden]``, attention_mask ``[B, T]`` or None, *, cu_seqlens=None,
    position_ids=None) -> ``[B, T, hidden]`` (a MindSpore Cell's ``construct``). Packed documents
    (B = 1): ``cu_seqlens`` int ``[N+1]`` (fla's) or ``position_ids`` ``[1, T]`` restarting at 0 per
    document (transformers' ``DataCollatorWithFlattening``); the conv and the state restart at every
    document.
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        init_layer_dims(
            self,
            hidden_size=hidden_size,
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            conv_kernel_size=conv_kernel_size,
            norm_eps=norm_eps,
        )
        # the order in which parameters are made is the order in which they draw random numbers
        self.in_proj_qkv = self._linear(hidden_size, self.conv_dim)
        self.in_proj_z = self._linear(hidden_size, self.value_dim)
        self.in_proj_b = self._linear(hidden_size, num_v_heads)
        self.in_proj_a = self._linear(hidden_size, num_v_heads)
        self.conv1d = self._causal_conv(self.conv_dim, conv_kernel_size)
        self.dt_bias = self._ones("dt_bias", num_v_heads)
        self.A_log = self._log_uniform("A_log", num_v_heads, 0.01, 16)
        self.norm = self._gated_norm(head_v_dim, norm_eps)
        self.out_proj = self._linear(self.value_dim, hidden_size)

    def forward(
        self,
        hidden_states: Any,
        attention_mask: Any = None,
        *,
        cu_seqlens: Any = None,
        position_ids: Any = None,
        prefill_states: PrefillStates | None = None,
    ) -> Any:
        """The layer on ``hidden_states`` ``[B, T, hidden]`` -> ``[B, T, hidden]``.

        Args:
            attention_mask: ``[B, T]`` (1 = token, 0 = padding): padded rows are zeroed before the
                projections, or None.
            cu_seqlens: packed documents (B = 1), int ``[N+1]``: the state and the causal conv
                restart at every document. Under context parallelism: the whole sequence's
                boundaries, the same tensor on every rank.
            position_ids: ``[B, T]`` restarting at 0 at every document (transformers' packed
                convention); one device only (a shard's positions cannot say where the documents
                of other shards start).
            prefill_states: an inference prefill's record
                (:class:`~hyperpar_gdn.ops.prefill_states.PrefillStates`): the layer hands it its
                decoding state after the last token.

        After :class:`~hyperpar_gdn.LinearAttentionContextParallel` ``.apply``, ``hidden_states``
        and the result are this rank's shard ``[B, T_r, hidden]`` (and ``attention_mask`` its
        ``[B, T_r]`` shard).
        """
        return layer_forward(
            self,
            hidden_states,
            attention_mask,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            prefill_states=prefill_states,
        )

    # --- what each framework provides ----------------------------------------------------------
    def _linear(self, in_features: int, out_features: int) -> Any:
        """A linear layer without bias, weight ``[out, in]``."""
        raise NotImplementedError

    def _causal_conv(self, channels: int, width: int) -> Any:
        """A depthwise causal conv without bias, weight ``[channels, 1, width]``."""
        raise NotImplementedError

    def _ones(self, name: str, size: int) -> Any:
        """A parameter ``[size]`` of ones."""
        raise NotImplementedError

    def _log_uniform(self, name: str, size: int, low: float, high: float) -> Any:
        """A parameter ``[size]``: the log of uniform draws in ``[low, high)``."""
        raise NotImplementedError

    def _gated_norm(self, dim: int, eps: float) -> Any:
        """The gated RMSNorm over ``dim``."""
        raise NotImplementedError


class AttentionShell:
    """Causal multi-head softmax attention with grouped KV heads, q/k RMSNorm, RoPE and a sigmoid
    output gate (Qwen3.5's full-attention layer, without a KV cache).

    Args:
        hidden_size: model width.
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (H must be a multiple).
        head_dim: per-head dim D (even, for RoPE).
        rope_theta: RoPE base.
        norm_eps: epsilon of the q/k RMSNorms.
        rotary_dim: the leading dims of each head that RoPE rotates (None: all D; Qwen3.5 rotates
            ``partial_rotary_factor * D``).
        zero_centred_norms: q/k norms are Qwen3.5's ``x / rms(x) * (1 + weight)``.

    forward(hidden_states ``[B, T, hidden]``) -> ``[B, T, hidden]`` (a MindSpore Cell's
    ``construct``); token t sits at position t.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
        rotary_dim: int | None = None,
        zero_centred_norms: bool = False,
    ) -> None:
        super().__init__()
        init_attention_dims(
            self,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rotary_dim=rotary_dim,
        )
        self.q_proj = self._linear(hidden_size, 2 * num_heads * head_dim)  # query and gate
        self.k_proj = self._linear(hidden_size, num_kv_heads * head_dim)
        self.v_proj = self._linear(hidden_size, num_kv_heads * head_dim)
        self.o_proj = self._linear(num_heads * head_dim, hidden_size)
        self.q_norm = self._rms_norm(head_dim, norm_eps, zero_centred_norms)
        self.k_norm = self._rms_norm(head_dim, norm_eps, zero_centred_norms)

    def attend(self, q_BHTD: Any, k_BHTD: Any, v_BHTD: Any, *, q_offset: int) -> Any:
        """Causal attention -> ``[B, Tq, H*D]``: query i sits at global position ``q_offset + i``
        and sees keys ``j <= q_offset + i`` (keys are positions ``0 .. Tk-1``)."""
        return causal_attention(ops_for(q_BHTD), q_BHTD, k_BHTD, v_BHTD, q_offset=q_offset)

    # --- what each framework provides ----------------------------------------------------------
    def _linear(self, in_features: int, out_features: int) -> Any:
        """A linear layer without bias, weight ``[out, in]``."""
        raise NotImplementedError

    def _rms_norm(self, dim: int, eps: float, zero_centred: bool) -> Any:
        """An RMSNorm over ``dim``."""
        raise NotImplementedError


class MLPShell:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``[..., C]`` -> ``[..., C]`` (parameters
    ``gate_proj``, ``up_proj`` ``[I, C]``, ``down_proj`` ``[C, I]``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = self._linear(hidden_size, intermediate_size)
        self.up_proj = self._linear(hidden_size, intermediate_size)
        self.down_proj = self._linear(intermediate_size, hidden_size)

    def forward(self, x: Any) -> Any:
        parts = (projection(self.gate_proj), projection(self.up_proj), projection(self.down_proj))
        return swiglu_of(ops_for(x), x, *parts)

    def _linear(self, in_features: int, out_features: int) -> Any:
        """A linear layer without bias, weight ``[out, in]``."""
        raise NotImplementedError


class DecoderBlockShell:
    """Pre-norm block ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``, whose token mixer is
    ``linear_attn`` (GDN) or ``self_attn`` (softmax), built from a model config's block-building
    interface (:class:`~hyperpar_gdn.models.block_config.DecoderSizes`).

    forward(x ``[B, T, C]``, cu_seqlens=None, cp_context=None) -> ``[B, T, C]``; ``cu_seqlens``
    (packed documents) goes to the mixer, and so does ``cp_context`` (the model's per-forward
    context under context parallelism, :class:`~hyperpar_gdn.distributed.sequence.GlobalSequence`,
    which then carries the documents)."""

    def __init__(self, config: Any, layer_type: str) -> None:
        super().__init__()
        self.layer_type = check_layer_type(layer_type)
        self.input_layernorm = self._rms_norm(config)
        if layer_type == LINEAR:
            self.linear_attn = self._gdn(config)
        else:
            self.self_attn = self._attention(config)
        self.post_attention_layernorm = self._rms_norm(config)
        self.mlp = self._mlp(config)

    @property
    def mixer(self) -> Any:
        return self.linear_attn if self.layer_type == LINEAR else self.self_attn

    def forward(self, x_BTC: Any, cu_seqlens: Any = None, cp_context: Any = None) -> Any:
        if cp_context is not None:  # under context parallelism: the model's per-forward context
            mixer = lambda h: self.mixer(h, cp_context=cp_context)  # noqa: E731
        elif cu_seqlens is not None:
            mixer = lambda h: self.mixer(h, cu_seqlens=cu_seqlens)  # noqa: E731
        else:
            mixer = self.mixer
        return decoder_block(
            x_BTC,
            mixer=mixer,
            mlp=self.mlp,
            input_norm=self.input_layernorm,
            post_norm=self.post_attention_layernorm,
        )

    # --- what each framework provides ----------------------------------------------------------
    def _rms_norm(self, config: Any) -> Any:
        """An RMSNorm over the model width, of the config's kind."""
        raise NotImplementedError

    def _gdn(self, config: Any) -> Any:
        raise NotImplementedError

    def _attention(self, config: Any) -> Any:
        raise NotImplementedError

    def _mlp(self, config: Any) -> Any:
        raise NotImplementedError
