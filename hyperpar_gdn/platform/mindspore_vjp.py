"""A MindSpore cell that applies a forward with a hand-written backward: what
:meth:`hyperpar_gdn.platform.mindspore_ops.MindSporeOps.custom_vjp` builds per call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
from mindspore import nn, ops

__all__ = ["CustomVJPCell"]


class CustomVJPCell(nn.Cell):
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
