"""Tensor functions for MindSpore 2.10 in PyNative mode (CPU measured; Ascend chosen by device target).

Many ``mindspore.mint`` functions have no CPU kernel in 2.10 and fail late, at the next sync
(docs/backends.md), so on CPU this module uses the Tensor methods and ``mindspore.ops``
functions measured to work there with gradients; on Ascend it prefers the ``mint`` kernels.

Three MindSpore habits the maths must not notice:

- A Python float in an expression is rounded to float32 even when the tensor is float64, so
  :meth:`MindSporeOps.scalar` builds a tensor of the input dtype.
- A ``Cell`` with ``bprop`` replaces autograd for its ``construct``; :meth:`MindSporeOps.custom_vjp`
  builds one per call and keeps the forward's saved tensors on it for the backward.
- A ``Parameter`` passed straight into such a cell gets its gradient through float32, so
  :meth:`MindSporeOps.custom_vjp` passes it a copy.

Speed on CPU (2.10, PyNative with kernels launched synchronously; measured on [32, 1, 4, 64, 128]
fp32 tensors, one thread): a same-shape elementwise op takes ~0.1 ms, but the CPU kernels that
broadcast, reduce or read a strided view are 10-100x slower than torch's. ``mint.matmul`` of a
transposed view copies it first (17 ms; ``BatchMatMul(transpose_b=True)`` on the untransposed
tensor: 0.9 ms), ``permute(...).contiguous()`` takes 9 ms (a row gather with the same result:
0.3 ms), ``sum`` over the last dim 1.8 ms (a matmul with a ones vector: 0.3 ms). So on CPU
:meth:`MindSporeOps.matmul`, :meth:`~MindSporeOps.permute` and :meth:`~MindSporeOps.sum` take those
faster routes where they give the same result, and fall back to the plain kernels elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import mindspore.scipy.linalg as ms_linalg
import numpy as np
from mindspore import mint, ops

from hyperpar_gdn.platform.base import IGNORE_INDEX, AttentionKernel, TensorOps
from hyperpar_gdn.platform.mindspore_vjp import CustomVJPCell

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


def _transposed_base(x: ms.Tensor) -> ms.Tensor | None:
    """The contiguous tensor whose last two dims ``x`` views swapped (``y.swapaxes(-1, -2)`` of a
    contiguous ``y``), or None when ``x`` is contiguous or some other view."""
    if x.ndim < 2 or x.is_contiguous():
        return None
    base = x.swapaxes(-1, -2)
    return base if base.is_contiguous() else None


def _gather_rows(x: ms.Tensor, index: ms.Tensor, shape: tuple[int, ...]) -> ms.Tensor:
    """The rows (``[..., D]`` vectors) of ``x`` at ``index``, reshaped to ``shape``."""
    return ops.gather(x.reshape(-1, x.shape[-1]), index, 0).reshape(shape)


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
    prefers_batched_loops = True  # ~0.05-0.1 ms a call in PyNative, about 5x torch's

    def __init__(self, device_target: str | None = None) -> None:
        target = device_target if device_target is not None else ms.get_context("device_target")
        self.device_target = str(target)
        self._ascend = self.device_target == "Ascend"
        self.prefers_written_backward = not self._ascend
        # CPU fast routes (see the module docstring); caches keyed by shape and dtype.
        self._matmul_prims: dict[tuple[bool, bool, bool], Any] = {}
        self._row_orders: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[ms.Tensor, ms.Tensor]] = {}
        self._ones: dict[tuple[tuple[int, ...], Any], ms.Tensor] = {}

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

    def softmax_exp(self, x: ms.Tensor) -> ms.Tensor:
        # The float32 kernel itself (measured on [3072, 512]: 1.7 ms against 21 ms through float64);
        # float64 scores keep their exact kernel.
        return mint.exp(x)

    def log(self, x: ms.Tensor) -> ms.Tensor:
        return ops.log(x)

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

    def mul(self, a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
        if self._ascend or a.shape == b.shape or a.ndim == 0 or b.ndim == 0:
            return a * b
        # Tile the broadcast side to the full shape (CPU, [32, 1, 4, 64, 128] * [32, 1, 4, 64, 1]:
        # 3.6 ms broadcast, 0.35 ms tiled then multiplied).
        a, b = self._tiled(a, b)
        return a * b

    def sub(self, a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
        if self._ascend or a.shape == b.shape or a.ndim == 0 or b.ndim == 0:
            return a - b
        a, b = self._tiled(a, b)  # as in mul
        return a - b

    def _tiled(self, a: ms.Tensor, b: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor]:
        shape = tuple(int(d) for d in np.broadcast_shapes(tuple(a.shape), tuple(b.shape)))
        return self._expand(a, shape), self._expand(b, shape)

    @staticmethod
    def _expand(x: ms.Tensor, shape: tuple[int, ...]) -> ms.Tensor:
        if tuple(x.shape) == shape:
            return x
        x = x.reshape((1,) * (len(shape) - x.ndim) + tuple(x.shape))
        return ops.tile(x, tuple(n if d == 1 else 1 for d, n in zip(x.shape, shape, strict=True)))

    def sum(self, x: ms.Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> ms.Tensor:
        dims = sorted({d % x.ndim for d in (dim if isinstance(dim, tuple) else (dim,))}) if x.ndim else []
        if (
            self._ascend
            or not dims
            or x.dtype not in (ms.float32, ms.float64)
            or dims != list(range(dims[0], dims[-1] + 1))
            or x.size == 0
            or not x.is_contiguous()
        ):
            return x.sum(axis=dim, keepdims=keepdim)
        # Contiguous dims summed as a product with ones: [pre, n, post] -> [pre, 1, post].
        shape = tuple(x.shape)
        pre, n = math.prod(shape[: dims[0]]), math.prod(shape[dims[0] : dims[-1] + 1])
        post = math.prod(shape[dims[-1] + 1 :])
        if post == 1:
            out = self._matmul_prim(2, False, False)(x.reshape(pre, n), self._ones_like((n, 1), x))
        else:
            out = self._matmul_prim(3, False, False)(self._ones_like((pre, 1, n), x), x.reshape(pre, n, post))
        kept = tuple(1 if i in dims else d for i, d in enumerate(shape))
        return out.reshape(kept if keepdim else tuple(d for i, d in enumerate(shape) if i not in dims))

    def _ones_like(self, shape: tuple[int, ...], like: ms.Tensor) -> ms.Tensor:
        key = (shape, like.dtype)
        if key not in self._ones:
            self._ones[key] = ops.ones(shape, like.dtype)
        return self._ones[key]

    def amax(self, x: ms.Tensor, dim: int, keepdim: bool = False) -> ms.Tensor:
        return x.max(axis=dim, keepdims=keepdim)

    def maximum(self, a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
        return ops.maximum(a, b)

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
        dims = tuple(int(d) % x.ndim for d in dims) if x.ndim else ()
        if self._ascend or x.ndim < 2 or dims[-1] != x.ndim - 1 or x.size == 0 or not x.is_contiguous():
            return x.permute(*dims).contiguous()
        # The last dim stays: the result is x's rows ([..., D] vectors) in a new order, one gather.
        index, inverse = self._row_order(tuple(x.shape), dims)
        in_shape, out_shape = tuple(x.shape), tuple(x.shape[d] for d in dims)
        return self.custom_vjp(
            lambda y: ((_gather_rows(y, index, out_shape),), ()),
            lambda saved, dy: (_gather_rows(dy, inverse, in_shape),),
            x,
        )[0]

    def _row_order(self, shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[ms.Tensor, ms.Tensor]:
        """Row indices taking ``shape``'s rows to the order of ``dims``, and back (int32, cached)."""
        key = (shape, dims)
        if key not in self._row_orders:
            rows = np.arange(math.prod(shape[:-1]), dtype=np.int64).reshape(shape[:-1])
            order = rows.transpose(dims[:-1]).reshape(-1)
            inverse = np.empty_like(order)
            inverse[order] = np.arange(order.size)
            itype = np.int32 if order.size < 2**31 else np.int64
            self._row_orders[key] = (ms.Tensor(order.astype(itype)), ms.Tensor(inverse.astype(itype)))
        return self._row_orders[key]

    def cat(self, xs: Sequence[ms.Tensor], dim: int) -> ms.Tensor:
        return ops.cat(tuple(xs), dim)

    def stack(self, xs: Sequence[ms.Tensor], dim: int) -> ms.Tensor:
        return mint.stack(tuple(xs), dim) if self._ascend else ops.stack(tuple(xs), dim)

    def split(self, x: ms.Tensor, sizes: Sequence[int], dim: int) -> list[ms.Tensor]:
        return list(ops.split(x, list(sizes), dim % x.ndim))

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

    def add_rows(self, x: ms.Tensor, index: Any, rows: ms.Tensor) -> ms.Tensor:
        return ops.tensor_scatter_add(x, ms.Tensor(np.asarray(index, dtype=np.int64).reshape(-1, 1)), rows)

    # --- linear algebra ----------------------------------------------------------------------
    def matmul(self, a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
        if self._ascend or a.ndim != b.ndim or a.ndim < 2 or a.shape[:-2] != b.shape[:-2]:
            return mint.matmul(a, b)
        # Same batch dims: (Batch)MatMul reads a transposed view through its transpose flag
        # instead of copying it.
        a_base, b_base = _transposed_base(a), _transposed_base(b)
        prim = self._matmul_prim(a.ndim, a_base is not None, b_base is not None)
        return prim(a if a_base is None else a_base, b if b_base is None else b_base)

    def _matmul_prim(self, ndim: int, transpose_a: bool, transpose_b: bool) -> Any:
        key = (ndim > 2, transpose_a, transpose_b)
        if key not in self._matmul_prims:
            cls = ops.BatchMatMul if ndim > 2 else ops.MatMul
            self._matmul_prims[key] = cls(transpose_a=transpose_a, transpose_b=transpose_b)
        return self._matmul_prims[key]

    def tril(self, x: ms.Tensor, diagonal: int = 0) -> ms.Tensor:
        return mint.tril(x, diagonal) if self._ascend else x.tril(diagonal)

    def flush_subnormal(self, x: ms.Tensor) -> ms.Tensor:
        # The bound as a tensor of x's dtype: a Python float would be rounded to float32, and
        # float64's smallest normal (2.2e-308) is 0 in float32, which flushed nothing.
        tiny = self.scalar(float(np.finfo(ms.dtype_to_nptype(x.dtype)).tiny), x)
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

    def attention_kernel(self, q: ms.Tensor) -> AttentionKernel | None:
        """Ascend: ``FlashAttentionScore`` for fp16/bf16 (not run here); CPU: none."""
        if self._ascend and q.dtype in (ms.float16, ms.bfloat16):
            from hyperpar_gdn.platform.mindspore_attention import ascend_kernel

            return ascend_kernel()
        return None

    def cross_entropy_sum(
        self, logits: ms.Tensor, labels: ms.Tensor, *, ignore_index: int = IGNORE_INDEX
    ) -> ms.Tensor:
        logits = self.cast(logits, self.compute_dtype(logits)).reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1).astype(ms.int32)
        keep = labels != ignore_index
        if logits.dtype == ms.float64:
            # ops.log_softmax keeps only ~4e-6 of float64 on CPU (measured against torch); the
            # formula keeps rounding-level agreement, gradient included.
            shifted = logits - ops.stop_gradient(ops.amax(logits, -1, True))
            log_probs = shifted - ops.log(ops.exp(shifted).sum(-1, keepdims=True))
        else:
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
        # A Parameter's gradient through a bprop cell is rounded to float32 (float64 weights came
        # back 1e-8 off); through a copy made by an op it keeps the weight's dtype.
        inputs = tuple(x + 0 if isinstance(x, ms.Parameter) else x for x in inputs)
        return CustomVJPCell(forward, backward)(*inputs)
