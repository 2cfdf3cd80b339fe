"""MindSpore on Ascend: the fused ``FlashAttentionScore`` kernel and its gradient as an
:class:`AttentionKernel` (fp16/bf16, layout BNSD, grouped KV heads natively).

Causal squares use sparse mode 2 (top-left causal) with the 2048 x 2048 compressed mask (1 =
hidden). The log-sum-exp is ``softmax_max + log(softmax_sum)`` of the kernel's outputs; the
backward gets the merged log-sum-exp as softmax_max with softmax_sum = 1. Written from the
operators' documentation in MindSpore 2.10; not run (no Ascend device here). MindSpore on CPU has
no such kernel: the blockwise path of :mod:`hyperpar_gdn.ops.attention.softmax` serves it.
"""

from __future__ import annotations

from functools import cache

import mindspore as ms
from mindspore import ops

from hyperpar_gdn.platform.attention_kernel import AttentionKernel

_NO_LIMIT = 2147483647  # pre/next tokens: no sliding window


class AscendFlashKernel(AttentionKernel):
    name = "mindspore-ascend-flash"
    _SUMS = 8  # softmax max/sum are replicated over a last dim of 8

    def __init__(self) -> None:
        self._mask: ms.Tensor | None = None
        self._prims: dict[tuple[str, int, float, bool], object] = {}

    def _causal_mask(self) -> ms.Tensor:
        if self._mask is None:
            self._mask = ops.triu(ops.ones((2048, 2048), ms.uint8), 1)
        return self._mask

    def _prim(self, kind: str, heads: int, scale: float, causal: bool) -> object:
        key = (kind, heads, scale, causal)
        if key not in self._prims:
            from mindspore.ops.operations import _grad_ops, nn_ops

            cls = nn_ops.FlashAttentionScore if kind == "forward" else _grad_ops.FlashAttentionScoreGrad
            self._prims[key] = cls(
                head_num=heads,
                scale_value=scale,
                pre_tokens=_NO_LIMIT,
                next_tokens=0 if causal else _NO_LIMIT,
                input_layout="BNSD",
                sparse_mode=2 if causal else 0,
            )
        return self._prims[key]

    def forward(
        self, q: ms.Tensor, k: ms.Tensor, v: ms.Tensor, *, causal: bool, scale: float
    ) -> tuple[ms.Tensor, ms.Tensor]:
        prim = self._prim("forward", q.shape[1], scale, causal)
        mask = self._causal_mask() if causal else None
        softmax_max, softmax_sum, _, o = prim(q, k, v, None, None, None, mask)
        return o, softmax_max[..., 0] + ops.log(softmax_sum[..., 0])

    def backward(self, do, q, k, v, o, lse, *, causal: bool, scale: float) -> tuple[ms.Tensor, ...]:
        # arguments as AttentionKernel.backward: do, q, o [B, H, Tq, D], k, v [B, Hkv, Tk, D], lse [B, H, Tq]
        prim = self._prim("backward", q.shape[1], scale, causal)
        mask = self._causal_mask() if causal else None
        softmax_max = ops.tile(lse.reshape(*lse.shape, 1), (1,) * lse.ndim + (self._SUMS,))
        dq, dk, dv, _ = prim(
            q, k, v, do, None, None, None, mask, softmax_max, ops.ones_like(softmax_max), None, o
        )
        return dq, dk, dv


@cache
def ascend_kernel() -> AscendFlashKernel:
    return AscendFlashKernel()
