"""RMSNorm (plain, or Qwen3.5's zero-centred one), normalised in the compute dtype; the maths is
:func:`hyperpar_gdn.ops.blocks.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar_gdn.ops.blocks import rms_norm
from hyperpar_gdn.platform import ops_for


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim; with ``zero_centred``, ``x / rms(x) * (1 + weight)``
    and the weight starts at zeros (transformers' ``Qwen3_5RMSNorm``).

    Example:
        >>> norm = RMSNorm(8)
        >>> tuple(norm(torch.randn(2, 3, 8)).shape)
        (2, 3, 8)
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, zero_centred: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(ops_for(x), x, self.weight, self.eps, zero_centred=self.zero_centred)
