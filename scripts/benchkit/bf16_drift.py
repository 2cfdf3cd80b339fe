"""``bench_bf16_drift``'s measurement: how far each CP mode's bf16 run strays from fp64 truth.

A GDN layer is run as a user runs it in bf16: its weights cast to bf16 (``layer.bfloat16()``,
no autocast) and bf16 inputs. The truth is the same layer on one device in fp64, with the same
bf16-rounded weights, input and output gradient upcast, so every difference is rounding inside
the run. The state modes (p2p, all_gather, scan) carry states, summaries and their
compositions in fp32; ulysses runs each head over the whole sequence as one device would. The
question is whether the summary modes drift further from the truth than ulysses does.

- :func:`drift_layer`: the layer (slow decays, so that the state entering a shard matters: the
  per-token decay |g| spans 1e-4 to 1e-2 over the heads).
- :func:`truth` (one process): the fp64 one-device output, input gradient and parameter
  gradients, and the bf16 one-device run's (the floor no CP mode can beat).
- :func:`run_modes` (a rank of :func:`benchkit.ranks.on_ranks`): each mode's bf16 output and
  gradient shards and parameter gradients on this rank, as float64 numpy arrays.
- :func:`drift` (the parent): each mode's relative errors against the truth (max-abs and RMS),
  parameter gradients summed over ranks in fp64 (the reduction's own rounding left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.planning.plan import MODES

__all__ = ["MODES", "DriftShape", "drift", "drift_layer", "run_modes", "truth"]


@dataclass(frozen=True)
class DriftShape:
    """The layer's geometry (small: T = 32K at cp 8 runs in about a minute here)."""

    hidden: int = 64
    num_k_heads: int = 2
    num_v_heads: int = 8
    head_k_dim: int = 16
    head_v_dim: int = 16


def drift_layer(shape: DriftShape, dtype: Any) -> Any:
    """The bf16-rounded layer (seed 0) in ``dtype`` (``torch.bfloat16`` or ``torch.float64``)."""
    import torch

    from hyperpar_gdn.models import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(
        shape.hidden, shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    )
    with torch.no_grad():
        for p in layer.parameters():  # off the init, so every gradient is exercised
            p.add_(0.1 * torch.randn_like(p))
        # |g| = exp(A_log) softplus(a + dt_bias) ~ A x 0.02: A log-uniform in [0.005, 0.5]
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(np.log(0.005), np.log(0.5)))
        layer.dt_bias.add_(-4.0)
    return layer.bfloat16().to(dtype)


def inputs(seq_len: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and the output gradient ``[1, T, hidden]``, rounded to bf16 (held as float64)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    x, cot = (torch.randn(1, seq_len, hidden, generator=gen).bfloat16().double() for _ in range(2))
    return x.numpy(), cot.numpy()


def _run(layer: Any, x: np.ndarray, cot: np.ndarray, dtype: Any) -> dict[str, np.ndarray]:
    """Output, input gradient and parameter gradients of ``layer`` (float64 numpy)."""
    import torch

    x_t = torch.from_numpy(x).to(dtype).requires_grad_(True)
    out = layer(x_t)
    (out * torch.from_numpy(cot).to(dtype)).sum().backward()
    result = {"output": out.detach(), "grad_input": x_t.grad}
    result |= {f"grad_{n}": p.grad for n, p in layer.named_parameters()}
    return {k: v.double().numpy() for k, v in result.items()}


def truth(shape: DriftShape, seq_len: int) -> dict[str, dict[str, np.ndarray]]:
    """``{"fp64": ..., "bf16": ...}``: the one-device runs, each a dict of float64 arrays."""
    import torch

    x, cot = inputs(seq_len, shape.hidden)
    return {
        name: _run(drift_layer(shape, dtype), x, cot, dtype)
        for name, dtype in (("fp64", torch.float64), ("bf16", torch.bfloat16))
    }


def run_modes(rank: int, cp: int, shape: DriftShape, seq_len: int, modes: tuple[str, ...]) -> dict:
    """This rank's ``{mode: {"output": [1, T/cp, hidden], "grad_input": ..., "grad_<p>": ...}}``
    in bf16 (contiguous shards of T/cp tokens), as float64 numpy arrays."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    x, cot = inputs(seq_len, shape.hidden)
    local = slice(rank * seq_len // cp, (rank + 1) * seq_len // cp)
    out = {}
    for mode in modes:
        layer = LinearAttentionContextParallel(mode).apply(drift_layer(shape, torch.bfloat16), mesh)
        out[mode] = _run(layer, x[:, local], cot[:, local], torch.bfloat16)
    return out


def _errors(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    errors = {}
    for key, expected in ref.items():
        diff = got[key] - expected
        errors[key] = {
            "max": float(np.abs(diff).max() / max(np.abs(expected).max(), 1e-30)),
            "rms": float(np.linalg.norm(diff) / max(np.linalg.norm(expected), 1e-30)),
        }
    return errors


def drift(per_rank: list[dict], reference: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Per mode (and ``single_bf16``): ``{tensor: {"max": e, "rms": e}}`` against the fp64 truth;
    output and input-gradient shards concatenated in rank order, parameter gradients summed."""
    truth64 = reference["fp64"]
    result = {"single_bf16": _errors(reference["bf16"], truth64)}
    for mode in per_rank[0]:
        got = {}
        for key in truth64:
            parts = [r[mode][key] for r in per_rank]
            got[key] = np.concatenate(parts, axis=1) if key in ("output", "grad_input") else sum(parts)
        result[mode] = _errors(got, truth64)
    return result


def worst_ratios(errors: dict[str, Any], *, metric: str = "max") -> dict[str, tuple[str, float]]:
    """Per summary mode: the tensor where its error is largest relative to ulysses', and that ratio."""
    base = errors["ulysses"]
    worst = {}
    for mode, per_tensor in errors.items():
        if mode in ("ulysses", "single_bf16"):
            continue
        ratios = {k: v[metric] / max(base[k][metric], 1e-30) for k, v in per_tensor.items()}
        key = max(ratios, key=ratios.__getitem__)
        worst[mode] = (key, ratios[key])
    return worst
