"""RMSNorm as a ``mindspore.nn.Cell`` with the torch module's parameter name ``weight``; like
:class:`hyperpar_gdn.models.RMSNorm` it normalises in fp32 whatever the input dtype."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from hyperpar_gdn.platform import Tensor, TensorOps, ops_for

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(xp: TensorOps, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)`` over the last dim, normalised in fp32 (as torch's
    :class:`hyperpar_gdn.models.RMSNorm`, even for fp64 input); the result has x's dtype."""
    dtype = xp.dtype(x)
    x_ct = xp.cast(x, ms.float32)
    mean_sq = xp.sum(x_ct * x_ct, -1, keepdim=True) / xp.scalar(float(x.shape[-1]), x_ct)
    return weight * xp.cast(x_ct * xp.rsqrt(mean_sq + xp.scalar(eps, x_ct)), dtype)


class RMSNorm(nn.Cell):
    """``weight * x / rms(x)`` over the last dim.

    Example:
        >>> norm = RMSNorm(8)
        >>> tuple(norm(ms.ops.ones((2, 3, 8))).shape)
        (2, 3, 8)
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = Parameter(ms.Tensor(np.ones(dim, np.float32)), name="weight")
        self.eps = eps

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return rms_norm(ops_for(x), x, self.weight, self.eps)
