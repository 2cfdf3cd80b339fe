"""RMSNorm as a ``mindspore.nn.Cell`` with the torch module's parameter name ``weight``; the maths
is :func:`hyperpar_gdn.ops.blocks.rms_norm`, as for :class:`hyperpar_gdn.models.RMSNorm`."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from hyperpar_gdn.ops.blocks import rms_norm
from hyperpar_gdn.platform import ops_for

__all__ = ["RMSNorm"]


class RMSNorm(nn.Cell):
    """``weight * x / rms(x)`` over the last dim; with ``zero_centred``, ``x / rms(x) * (1 + weight)``
    and the weight starts at zeros (transformers' ``Qwen3_5RMSNorm``).

    Example:
        >>> norm = RMSNorm(8)
        >>> tuple(norm(ms.ops.ones((2, 3, 8))).shape)
        (2, 3, 8)
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, zero_centred: bool = False) -> None:
        super().__init__()
        init = np.zeros(dim, np.float32) if zero_centred else np.ones(dim, np.float32)
        self.weight = Parameter(ms.Tensor(init), name="weight")
        self.eps = eps
        self.zero_centred = zero_centred

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return rms_norm(ops_for(x), x, self.weight, self.eps, zero_centred=self.zero_centred)
