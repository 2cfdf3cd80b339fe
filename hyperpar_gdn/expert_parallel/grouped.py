"""The routed experts' SwiGLU on tokens grouped by expert (torch).

Rows of ``x_MC`` come sorted by expert: ``counts[j]`` rows for local expert j, in expert order.
Each group goes through its expert: ``down_j(silu(gate_j(x)) * up_j(x))`` with the fused weights
as transformers' ``Qwen3_5MoeExperts`` holds them: ``gate_up [E, 2I, C]`` (gate rows ``[0, I)``, up
rows ``[I, 2I)``) and ``down [E, C, I]``.

- :func:`grouped_swiglu`: torch's grouped matrix multiply (``torch.nn.functional.grouped_mm``, one
  call per projection for all experts) where it runs: fp32, bf16 or fp16 rows whose sizes in bytes
  are multiples of 16; the loop below otherwise (fp64 among them).
- :func:`grouped_swiglu_loop`: the readable reference, one expert at a time.

Legend: M rows (token-expert pairs), C hidden size, I expert width, E local experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm_runs", "grouped_swiglu", "grouped_swiglu_loop"]

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_runs(x_MC: torch.Tensor, gate_up_EIC: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands (its dtype and 16-byte stride rules)."""
    if getattr(F, "grouped_mm", None) is None or x_MC.dtype not in _GROUPED_DTYPES:
        return False
    if gate_up_EIC.dtype != x_MC.dtype:
        return False
    size = x_MC.element_size()
    width = gate_up_EIC.shape[1] // 2
    return (x_MC.shape[-1] * size) % 16 == 0 and (width * size) % 16 == 0


def grouped_swiglu(
    x_MC: torch.Tensor, counts: Sequence[int], gate_up_EIC: torch.Tensor, down_ECI: torch.Tensor
) -> torch.Tensor:
    """``[M, C]``: row block j (``counts[j]`` rows) through expert j's SwiGLU; the grouped matmul
    where :func:`grouped_mm_runs`, else :func:`grouped_swiglu_loop`."""
    if len(counts) != gate_up_EIC.shape[0] or sum(counts) != x_MC.shape[0]:
        raise ValueError(
            f"counts={list(counts)} must give one group per expert ({gate_up_EIC.shape[0]}) and sum "
            f"to the rows of x ({x_MC.shape[0]})"
        )
    if not grouped_mm_runs(x_MC, gate_up_EIC):
        return grouped_swiglu_loop(x_MC, counts, gate_up_EIC, down_ECI)
    offsets = torch.cumsum(torch.as_tensor(list(counts)), 0).to(device=x_MC.device, dtype=torch.int32)
    h_MI2 = F.grouped_mm(x_MC.contiguous(), gate_up_EIC.transpose(1, 2), offs=offsets)
    width = down_ECI.shape[-1]
    act_MI = F.silu(h_MI2[:, :width]) * h_MI2[:, width:]
    out_MC = F.grouped_mm(act_MI.contiguous(), down_ECI.transpose(1, 2), offs=offsets)
    if out_MC.requires_grad:  # the grouped backward takes contiguous gradients only
        out_MC.register_hook(lambda g: g.contiguous())
    return out_MC


def grouped_swiglu_loop(
    x_MC: torch.Tensor, counts: Sequence[int], gate_up_EIC: torch.Tensor, down_ECI: torch.Tensor
) -> torch.Tensor:
    """The reference of :func:`grouped_swiglu`: one ``F.linear`` pair per expert with rows."""
    width = down_ECI.shape[-1]
    pieces = []
    start = 0
    for j, n in enumerate(counts):
        rows = x_MC[start : start + n]
        start += n
        h = F.linear(rows, gate_up_EIC[j])
        pieces.append(F.linear(F.silu(h[:, :width]) * h[:, width:], down_ECI[j]))
    if not pieces:
        return x_MC.new_zeros((0, down_ECI.shape[1]))
    return torch.cat(pieces, 0)
