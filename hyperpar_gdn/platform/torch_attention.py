"""Fused attention kernels of torch that return their log-sum-exp (see :class:`AttentionKernel`).

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype,
  grouped KV heads natively). Measured here.
- CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16) and
  ``aten._scaled_dot_product_efficient_attention`` (fp32), KV heads repeated to the query heads.
  Written from the operators' signatures; not run (no CUDA device here).
- NPU (torch-npu): ``torch_npu.npu_fusion_attention`` and ``npu_fusion_attention_grad``
  (fp16/bf16, grouped KV heads natively). Written from the operator's documentation; not run.

The backward of a rectangle takes the merged output and log-sum-exp of its queries' whole rows;
every kernel here computes ``P = exp(s - lse)`` and ``rowsum(dO * O)`` from them, so the per
rectangle gradients add up to the exact gradients of the merged attention.
"""

from __future__ import annotations

import torch

from hyperpar_gdn.platform.attention_kernel import AttentionKernel

__all__ = ["attention_kernel_for"]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv*G, T, D]`` gradients of repeated heads -> ``[B, Hkv, T, D]``."""
    if groups == 1:
        return dx
    b, h, t, d = dx.shape
    return dx.reshape(b, h // groups, groups, t, d).sum(2)


class CpuFlashKernel(AttentionKernel):
    name = "torch-cpu-flash"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return o, lse

    def backward(self, do, q, k, v, o, lse, *, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
        # arguments as AttentionKernel.backward: do, q, o [B, H, Tq, D], k, v [B, Hkv, Tk, D], lse [B, H, Tq]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(), q, k, v, o, lse, 0.0, causal, attn_mask=None, scale=scale
        )
        return dq, dk, dv


class CudaFlashKernel(AttentionKernel):
    """fp16/bf16 (flash) or fp32 (memory-efficient) SDPA kernels of CUDA. Not run here."""

    name = "torch-cuda-sdpa"

    def _flash(self, q: torch.Tensor) -> bool:
        return q.dtype in (torch.float16, torch.bfloat16)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        if self._flash(q):
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return out[0], out[1]
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out[0], out[1][..., : q.shape[2]]  # the kernel pads lse's last dim

    def backward(self, do, q, k, v, o, lse, *, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
        # arguments as AttentionKernel.backward: do, q, o [B, H, Tq, D], k, v [B, Hkv, Tk, D], lse [B, H, Tq]
        groups = q.shape[1] // k.shape[1]
        kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
        tq, tk = q.shape[2], k.shape[2]
        do = do.contiguous()
        if self._flash(q):
            cum = torch.empty(0, dtype=torch.int32, device=q.device)
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do, q, kr, vr, o, lse, cum, cum, tq, tk, 0.0, causal, seed, seed, scale=scale
            )
        else:
            padded = -(-tq // 32) * 32
            lse = torch.nn.functional.pad(lse, (0, padded - tq))
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                do, q, kr, vr, None, o, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale
            )
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


class NpuFusionKernel(AttentionKernel):
    """``torch_npu.npu_fusion_attention`` in layout BNSD; causal squares through sparse mode 2
    with its 2048 x 2048 compressed mask. The merged log-sum-exp goes back as softmax_max with
    softmax_sum = 1 (then ``exp(s - max) / sum`` is ``exp(s - lse)``). Not run here."""

    name = "torch-npu-fusion"
    _SUMS = 8  # the kernel keeps softmax max/sum replicated over a last dim of 8

    def __init__(self) -> None:
        self._masks: dict[object, torch.Tensor] = {}

    def _mask(self, device: object) -> torch.Tensor:
        if device not in self._masks:
            self._masks[device] = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
        return self._masks[device]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch_npu

        out = torch_npu.npu_fusion_attention(
            q,
            k,
            v,
            q.shape[1],
            "BNSD",
            atten_mask=self._mask(q.device) if causal else None,
            scale=scale,
            sparse_mode=2 if causal else 0,
        )
        o, softmax_max, softmax_sum = out[0], out[1], out[2]
        return o, softmax_max[..., 0] + torch.log(softmax_sum[..., 0])

    def backward(self, do, q, k, v, o, lse, *, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
        # arguments as AttentionKernel.backward: do, q, o [B, H, Tq, D], k, v [B, Hkv, Tk, D], lse [B, H, Tq]
        import torch_npu

        softmax_max = lse.unsqueeze(-1).expand(*lse.shape, self._SUMS).contiguous()
        out = torch_npu.npu_fusion_attention_grad(
            q,
            k,
            v,
            do.contiguous(),
            q.shape[1],
            "BNSD",
            atten_mask=self._mask(q.device) if causal else None,
            softmax_max=softmax_max,
            softmax_sum=torch.ones_like(softmax_max),
            attention_in=o,
            scale_value=scale,
            sparse_mode=2 if causal else 0,
        )
        return out[0], out[1], out[2]


_CPU = CpuFlashKernel()
_CUDA = CudaFlashKernel()
_NPU: NpuFusionKernel | None = None


def attention_kernel_for(q: torch.Tensor) -> AttentionKernel | None:
    """The kernel for ``q``'s device type and dtype, or None (then the blockwise path serves)."""
    global _NPU
    kind = q.device.type
    if kind == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return _CPU
    if kind == "cuda" and q.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return _CUDA
    if kind == "npu" and q.dtype in (torch.float16, torch.bfloat16):
        if _NPU is None:
            _NPU = NpuFusionKernel()
        return _NPU
    return None
