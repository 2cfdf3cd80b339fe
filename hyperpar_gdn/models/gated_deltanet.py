"""A Qwen3.5 Gated DeltaNet layer for PyTorch, with transformers' parameter names."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar_gdn.ops.gdn.layer import init_layer_dims, layer_forward
from hyperpar_gdn.ops.prefill_states import PrefillStates


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) * silu(gate) over the last dim (normalised in fp32)."""

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps


class GatedDeltaNet(nn.Module):
    """Qwen3.5 GDN layer; state dicts load both ways with transformers' ``Qwen3_5GatedDeltaNet``.

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: query/key heads and value heads (num_v_heads a multiple).
        head_k_dim, head_v_dim: per-head dims.
        conv_kernel_size: width W of the causal depthwise conv.
        norm_eps: epsilon of the gated RMSNorm.

    forward(hidden_states ``[B, T, hidden]``, attention_mask ``[B, T]`` or None, *, cu_seqlens=None,
    position_ids=None) -> ``[B, T, hidden]``. Packed documents (B = 1): ``cu_seqlens`` int ``[N+1]``
    (fla's) or ``position_ids`` ``[1, T]`` restarting at 0 per document (transformers'
    ``DataCollatorWithFlattening``); the conv and the state restart at every document.

    Example:
        >>> layer = GatedDeltaNet(64, 2, 4, 16, 16)
        >>> tuple(layer(torch.randn(2, 10, 64)).shape)
        (2, 10, 64)
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

        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=conv_kernel_size,
            groups=self.conv_dim,
            padding=conv_kernel_size - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        prefill_states: PrefillStates | None = None,
    ) -> torch.Tensor:
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
