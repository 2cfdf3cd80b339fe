"""Tensor functions for PyTorch (any device)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hyperpar_gdn.platform.base import IGNORE_INDEX, AttentionKernel, TensorOps
from hyperpar_gdn.platform.torch_attention import attention_kernel_for

SLICED_RUNS = 64  # take(): up to this many slices instead of an index copied to the device


class _CustomVJP(torch.autograd.Function):
    """Runs a forward function with a hand-written backward (see TensorOps.custom_vjp)."""

    @staticmethod
    def forward(ctx: Any, forward: Callable, backward: Callable, *inputs: torch.Tensor):
        outputs, saved = forward(*inputs)
        ctx.backward_fn = backward
        ctx.save_for_backward(*saved)
        ctx.num_outputs = len(outputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor):
        grads = ctx.backward_fn(ctx.saved_tensors, *grad_outputs)
        return (None, None, *grads)


class TorchOps(TensorOps):
    name = "torch"

    def is_tensor(self, x: object) -> bool:
        return isinstance(x, torch.Tensor)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def zeros(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)

    def eye(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.eye(n, dtype=like.dtype, device=like.device)

    def scalar(self, value: float, like: torch.Tensor) -> torch.Tensor:
        # filled on the device: torch.tensor(value, device=...) would copy from the host (on CUDA a
        # blocking copy); the same value in the same dtype
        return torch.full((), value, dtype=like.dtype, device=like.device)

    def constant(self, array: Any, like: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(array, device=like.device).to(like.dtype)

    def to_numpy(self, x: torch.Tensor) -> Any:
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    def log(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)

    def rsqrt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def sum(self, x: torch.Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> torch.Tensor:
        return x.sum(dim=dim, keepdim=keepdim)

    def amax(self, x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
        return x.amax(dim, keepdim=keepdim)

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b)

    def cumsum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.cumsum(dim)

    def softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.softmax(x, dim)

    def top_k_mask(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return x >= x.detach().topk(k, -1).values[..., k - 1 : k]

    def swapaxes(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return x.transpose(a, b)

    def permute(self, x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
        return x.permute(*dims).contiguous()

    def cat(self, xs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        return torch.cat(list(xs), dim=dim)

    def stack(self, xs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        return torch.stack(list(xs), dim=dim)

    def split(self, x: torch.Tensor, sizes: Sequence[int], dim: int) -> list[torch.Tensor]:
        return list(torch.split(x, list(sizes), dim=dim))

    def pad_dim(self, x: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
        if before == 0 and after == 0:
            return x
        dim = dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim) + [before, after]
        return F.pad(x, pad)

    def repeat_interleave(self, x: torch.Tensor, repeats: int, dim: int) -> torch.Tensor:
        return x if repeats == 1 else x.repeat_interleave(repeats, dim=dim)

    def take(self, x: torch.Tensor, index: Any, dim: int) -> torch.Tensor:
        """A host index made of at most ``SLICED_RUNS`` ascending runs (head and channel blocks)
        is taken as slices, without copying the index to the device; others by ``index_select``."""
        if not isinstance(index, torch.Tensor):
            host = np.asarray(index, dtype=np.int64).reshape(-1)
            breaks = np.flatnonzero(np.diff(host) != 1) + 1
            if host.size and breaks.size < SLICED_RUNS and host.min() >= 0:
                starts = np.concatenate([[0], breaks])
                ends = np.concatenate([breaks, [host.size]])
                parts = [x.narrow(dim, int(host[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]
                return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        return torch.index_select(x, dim, torch.as_tensor(index, dtype=torch.int64, device=x.device))

    def add_rows(self, x: torch.Tensor, index: Any, rows: torch.Tensor) -> torch.Tensor:
        return x.index_add(0, torch.as_tensor(index, dtype=torch.int64, device=x.device), rows)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # The state maths multiply in their own dtype (fp32 states, chunk products) also under
        # bf16 autocast, which would round them to bf16; projections use linear(), which it casts.
        if torch.is_autocast_enabled(a.device.type):
            with torch.autocast(a.device.type, enabled=False):
                return torch.matmul(a, b)
        return torch.matmul(a, b)

    def tril(self, x: torch.Tensor, diagonal: int = 0) -> torch.Tensor:
        return torch.tril(x, diagonal)

    def flush_subnormal(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x.abs() < torch.finfo(x.dtype).tiny, 0.0)

    def solve_unit_lower(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(a.device.type):
            with torch.autocast(a.device.type, enabled=False):
                return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)
        return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def arange(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, device=like.device)

    def masked_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        seen = visible.any(-1, keepdim=True)  # rows with at least one key
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | ~seen)
        return o * seen.to(o.dtype)

    def autocast_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        kind = x.device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None

    def attention_kernel(self, q: torch.Tensor) -> AttentionKernel | None:
        return attention_kernel_for(q)

    def cross_entropy_sum(
        self, logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
    ) -> torch.Tensor:
        logits = logits.to(self.compute_dtype(logits)).reshape(-1, logits.shape[-1])
        return F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")

    def depthwise_conv1d(self, x: torch.Tensor, weight: torch.Tensor, *, left_pad: int) -> torch.Tensor:
        x = F.pad(x, (left_pad, 0)) if left_pad else x
        return F.conv1d(x, weight.unsqueeze(1), groups=weight.shape[0])

    def custom_vjp(self, forward: Callable, backward: Callable, *inputs: torch.Tensor):
        return _CustomVJP.apply(forward, backward, *inputs)
