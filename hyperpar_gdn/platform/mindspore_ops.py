"""Tensor functions for MindSpore 2.10 in PyNative mode (CPU measured; Ascend chosen by device target).

Many ``mindspore.mint`` functions have no CPU kernel in 2.10 and fail late, at the next sync
(DESIGN.md section 4), so on CPU this module uses the Tensor methods and ``mindspore.ops``
functions measured to work there with gradients; on Ascend it prefers the ``mint`` kernels.

Two MindSpore habits the maths must not notice:

- A Python float in an expression is rounded to float32 even when the tensor is float64, so
  :meth:`MindSporeOps.scalar` builds a tensor of the input dtype.
- A ``Cell`` with ``bprop`` replaces autograd for its ``construct``; :meth:`MindSporeOps.custom_vjp`
  builds one per call and keeps the forward's saved tensors on it for the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import mindspore.scipy.linalg as ms_linalg
import numpy as np
from mindspore import mint, nn, ops

from .base import TensorOps

__all__ = ["MindSporeOps", "enable_launch_blocking"]

_launch_blocking = False


def enable_launch_blocking() -> None:
    """Run MindSpore kernels synchronously: on CPU the many small ops of the GDN maths run 5-30x
    faster (measured: chunked forward+backward at T=1024 about 10x, the token loop 30x).

    Process-wide and one-way (MindSpore has no switch back), so the platform calls it when it is
    set up rather than this module doing so at import. Idempotent."""
    global _launch_blocking
    if not _launch_blocking:
        ms.runtime.launch_blocking()
        _launch_blocking = True


class _CustomVJPCell(nn.Cell):
    """One application of ``forward`` with the hand-written ``backward`` (see TensorOps.custom_vjp).

    MindSpore runs ``construct`` without recording it when the cell has a ``bprop``, then calls
    ``bprop(*inputs, out, dout)``; the cell is used once, so the forward's saved tensors can stay
    on the instance until the backward reads them.
    """

    def __init__(self, forward: Callable, backward: Callable) -> None:
        super().__init__(auto_prefix=False)
        self._forward_fn = forward
        self._backward_fn = backward
        self._saved: tuple[ms.Tensor, ...] | None = None
        self._num_outputs = 0

    def construct(self, *inputs: ms.Tensor) -> tuple[ms.Tensor, ...]:
        outputs, saved = self._forward_fn(*inputs)
        self._saved = tuple(saved)
        self._num_outputs = len(outputs)
        return tuple(outputs)

    def bprop(self, *args: Any) -> tuple[ms.Tensor, ...]:
        inputs, dout = args[:-2], args[-1]
        # A single output arrives as a bare tensor rather than a 1-tuple.
        grad_outputs = tuple(dout) if isinstance(dout, (tuple, list)) else (dout,)
        if len(grad_outputs) != self._num_outputs:
            raise RuntimeError(
                f"custom_vjp: MindSpore passed {len(grad_outputs)} output gradients for "
                f"{self._num_outputs} outputs"
            )
        if self._saved is None:
            raise RuntimeError("custom_vjp: the backward ran twice for one forward (saved tensors are freed)")
        saved, self._saved = self._saved, None  # MindSpore may keep the cell after the backward
        grads = tuple(self._backward_fn(saved, *grad_outputs))
        if len(grads) != len(inputs):
            raise ValueError(f"custom_vjp: backward returned {len(grads)} gradients for {len(inputs)} inputs")
        return tuple(
            ops.zeros_like(x) if grad is None else grad for x, grad in zip(inputs, grads, strict=True)
        )


_SOFTPLUS_THRESHOLD = 20  # mint's and torch's: softplus(x) = x above it


def _softplus_forward(x: ms.Tensor) -> tuple[tuple[ms.Tensor], tuple[ms.Tensor]]:
    return (mint.nn.functional.softplus(x),), (x,)


def _softplus_backward(saved: tuple[ms.Tensor, ...], dy: ms.Tensor) -> tuple[ms.Tensor]:
    (x,) = saved
    return (ops.where(x > _SOFTPLUS_THRESHOLD, dy, dy * ops.sigmoid(x)),)


class MindSporeOps(TensorOps):
    """:class:`TensorOps` for MindSpore tensors in PyNative mode.

    Args:
        device_target: ``"CPU"`` or ``"Ascend"`` (others behave as CPU); default: MindSpore's
            current device target.
    """

    name = "mindspore"

    def __init__(self, device_target: str | None = None) -> None:
        target = device_target if device_target is not None else ms.get_context("device_target")
        self.device_target = str(target)
        self._ascend = self.device_target == "Ascend"

    def is_tensor(self, x: object) -> bool:
        return isinstance(x, ms.Tensor)

    # --- dtypes and creation --------------------------------------------------------------
    def compute_dtype(self, x: ms.Tensor) -> Any:
        return ms.float64 if x.dtype == ms.float64 else ms.float32

    def dtype(self, x: ms.Tensor) -> Any:
        return x.dtype

    def cast(self, x: ms.Tensor, dtype: Any) -> ms.Tensor:
        return x if x.dtype == dtype else x.astype(dtype)

    def zeros(self, shape: Sequence[int], like: ms.Tensor) -> ms.Tensor:
        return ops.zeros(tuple(int(d) for d in shape), like.dtype)

    def eye(self, n: int, like: ms.Tensor) -> ms.Tensor:
        return mint.eye(n, dtype=like.dtype)

    def scalar(self, value: float, like: ms.Tensor) -> ms.Tensor:
        return ms.tensor(value, dtype=like.dtype)

    def constant(self, array: Any, like: ms.Tensor) -> ms.Tensor:
        return ms.Tensor(np.asarray(array).astype(ms.dtype_to_nptype(like.dtype)))

    def to_numpy(self, x: ms.Tensor) -> Any:
        return (x.astype(ms.float32) if x.dtype == ms.bfloat16 else x).asnumpy()

    # --- elementwise and reductions ---------------------------------------------------------
    def _in_float64(self, fn: Callable[[ms.Tensor], ms.Tensor], x: ms.Tensor) -> ms.Tensor:
        """``fn(x)`` evaluated in float64 on CPU, where the float32 kernels of exp and sigmoid
        are off by up to 5e-6 and 3e-6 relative (torch's by 1e-7); float64 ones are exact."""
        if self._ascend or x.dtype == ms.float64:
            return fn(x)
        return fn(x.astype(ms.float64)).astype(x.dtype)

    def exp(self, x: ms.Tensor) -> ms.Tensor:
        return self._in_float64(mint.exp, x)

    def rsqrt(self, x: ms.Tensor) -> ms.Tensor:
        return ops.rsqrt(x)

    def sigmoid(self, x: ms.Tensor) -> ms.Tensor:
        return self._in_float64(ops.sigmoid, x)

    def softplus(self, x: ms.Tensor) -> ms.Tensor:
        if self._ascend:
            return mint.nn.functional.softplus(x)
        # On CPU ops.softplus has float32 accuracy in float64 too (and is 0 below -15.9); mint's
        # is exact in float64, with torch's threshold, but has no gradient kernel: use mint's with
        # the gradient written out (d softplus = sigmoid).
        return self._in_float64(lambda y: self.custom_vjp(_softplus_forward, _softplus_backward, y)[0], x)

    def silu(self, x: ms.Tensor) -> ms.Tensor:
        return mint.nn.functional.silu(x)

    def sum(self, x: ms.Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> ms.Tensor:
        return x.sum(axis=dim, keepdims=keepdim)

    def cumsum(self, x: ms.Tensor, dim: int) -> ms.Tensor:
        return mint.cumsum(x, dim) if self._ascend else x.cumsum(dim)

    def softmax(self, x: ms.Tensor, dim: int) -> ms.Tensor:
        return ops.softmax(x, dim)

    def top_k_mask(self, x: ms.Tensor, k: int) -> ms.Tensor:
        values, _ = ops.topk(ops.stop_gradient(x), k)
        return x >= values[..., k - 1 : k]

    # --- shapes -----------------------------------------------------------------------------
    def swapaxes(self, x: ms.Tensor, a: int, b: int) -> ms.Tensor:
        return x.swapaxes(a, b)

    def permute(self, x: ms.Tensor, dims: Sequence[int]) -> ms.Tensor:
        return x.permute(*dims).contiguous()

    def cat(self, xs: Sequence[ms.Tensor], dim: int) -> ms.Tensor:
        return ops.cat(tuple(xs), dim)

    def stack(self, xs: Sequence[ms.Tensor], dim: int) -> ms.Tensor:
        return mint.stack(tuple(xs), dim) if self._ascend else ops.stack(tuple(xs), dim)

    def pad_dim(self, x: ms.Tensor, dim: int, before: int, after: int) -> ms.Tensor:
        if before == 0 and after == 0:
            return x
        dim = dim % x.ndim
        padding = (0, 0) * (x.ndim - 1 - dim) + (before, after)  # last dim first, as torch's F.pad
        return ops.pad(x, padding)

    def repeat_interleave(self, x: ms.Tensor, repeats: int, dim: int) -> ms.Tensor:
        return x if repeats == 1 else x.repeat_interleave(repeats, dim)

    def take(self, x: ms.Tensor, index: Any, dim: int) -> ms.Tensor:
        return ops.gather(x, ms.Tensor(np.asarray(index, dtype=np.int64)), dim % x.ndim)

    # --- linear algebra ----------------------------------------------------------------------
    def matmul(self, a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
        return mint.matmul(a, b)

    def tril(self, x: ms.Tensor, diagonal: int = 0) -> ms.Tensor:
        return mint.tril(x, diagonal) if self._ascend else x.tril(diagonal)

    def flush_subnormal(self, x: ms.Tensor) -> ms.Tensor:
        tiny = float(np.finfo(ms.dtype_to_nptype(x.dtype)).tiny)
        return x.masked_fill(ops.abs(x) < tiny, 0.0)

    def solve_unit_lower(self, a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
        # Like torch's, the kernel reads only the strict lower part of a, and its gradient is
        # zero elsewhere (tests/platform/test_mindspore_ops.py checks both).
        return ms_linalg.solve_triangular(a, b, lower=True, unit_diagonal=True)

    def linear(self, x: ms.Tensor, weight: ms.Tensor) -> ms.Tensor:
        return mint.nn.functional.linear(x, weight)

    def arange(self, n: int, like: ms.Tensor) -> ms.Tensor:
        return ms.Tensor(np.arange(n, dtype=np.int64))

    def masked_attention(self, q: ms.Tensor, k: ms.Tensor, v: ms.Tensor, visible: ms.Tensor) -> ms.Tensor:
        seen = visible.any(-1, keep_dims=True)  # rows with at least one key
        scores = mint.matmul(q, k.swapaxes(-1, -2)) * self.scalar(q.shape[-1] ** -0.5, q)
        probs = ops.softmax(
            scores.masked_fill(ops.logical_not(visible | ops.logical_not(seen)), float("-inf")), -1
        )
        return mint.matmul(probs, v) * seen.astype(q.dtype)

    def cross_entropy_sum(
        self, logits: ms.Tensor, labels: ms.Tensor, *, ignore_index: int = -100
    ) -> ms.Tensor:
        logits = self.cast(logits, self.compute_dtype(logits)).reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1).astype(ms.int32)
        keep = labels != ignore_index
        log_probs = ops.log_softmax(logits, -1)
        picked = ops.gather_elements(log_probs, 1, (labels * keep.astype(ms.int32)).reshape(-1, 1))
        return -(picked.reshape(-1) * keep.astype(logits.dtype)).sum()

    def depthwise_conv1d(self, x: ms.Tensor, weight: ms.Tensor, *, left_pad: int) -> ms.Tensor:
        channels, width = weight.shape
        if left_pad:
            x = self.pad_dim(x, -1, left_pad, 0)
        if x.dtype == ms.float64:
            # The CPU conv kernel is float32 only; W shifted products keep float64 exact.
            steps = x.shape[-1] - width + 1
            w = weight.reshape(channels, width, 1)
            out = x[..., 0:steps] * w[:, 0]
            for j in range(1, width):
                out = out + x[..., j : j + steps] * w[:, j]
            return out
        out = ops.conv1d(
            x.astype(ms.float32),
            weight.reshape(channels, 1, width).astype(ms.float32),
            pad_mode="pad",
            padding=0,
            groups=channels,
        )
        return self.cast(out, x.dtype)

    # --- autograd -----------------------------------------------------------------------------
    def custom_vjp(
        self,
        forward: Callable[..., tuple[tuple[ms.Tensor, ...], tuple[ms.Tensor, ...]]],
        backward: Callable[..., tuple[ms.Tensor | None, ...]],
        *inputs: ms.Tensor,
    ) -> tuple[ms.Tensor, ...]:
        return _CustomVJPCell(forward, backward)(*inputs)
