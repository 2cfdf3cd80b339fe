"""The run header of ``scripts/train.py``: what runs where, and a note when CP cannot pay off."""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.ops.gdn.kernels import resolve_kernel
from hyperpar_gdn.planning.payoff import cp_advice
from hyperpar_gdn.train.config import TrainConfig


def run_header(
    config: TrainConfig,
    *,
    platform: str,
    world_size: int,
    dp: int,
    cp: int,
    tp: int = 1,
    parameters: int,
    first_step: int,
    cp_mode: str | None = None,
    model_config: dict[str, Any],
) -> list[str]:
    """The header lines: platform, ranks as dp x cp (x tp under ``--tp``; the experts' ep under
    ``--ep``) with the CP options (or
    "no context parallelism" at cp=1), model, dtype, tokens per step, steps, the GDN kernel under CP
    and why; then :func:`cp_advice`'s note (priced on a TP rank's heads under ``--tp``).
    ``parameters``: the whole model's (not a TP rank's share).
    ``cp_mode``: the mode ``--cp-mode auto`` chose (shown as ``auto: <mode>``), else None;
    ``model_config``: the model's config dict (its GDN sizes price the note)."""
    flags = "".join(f", --{name}" for name in ("fsdp", "ac") if getattr(config, name))
    mode = config.cp_mode if cp_mode is None else cp_mode
    if cp > 1:
        shown = config.cp_mode if cp_mode is None else f"auto: {cp_mode}"
        inner = f", --cp-inner-size {config.cp_inner_size}" if config.cp_inner_size is not None else ""
        what = f"--cp-mode {shown}{inner}, --cp-layout {config.token_layout()}{flags}"
    else:
        what = f"no context parallelism{flags}"
    mesh = f"dp {dp} x cp {cp}" + (f" x tp {tp}" if tp > 1 else "")
    if config.ep > 1:  # the experts' axis is carved out of dp x cp
        mesh += f", experts over ep {config.ep}"
    if config.router_aux_loss_coef:
        flags += f", --router-aux-loss-coef {config.router_aux_loss_coef:g}"
    lines = [
        f"platform {platform}, {world_size} rank{'s' if world_size > 1 else ''} = {mesh} ({what}), "
        f"model {config.model_name}: {parameters:,} parameters, --dtype {config.dtype}, "
        f"{config.batch_size * config.seq_len} tokens per step, steps {first_step}..{config.steps}"
    ]
    if cp > 1:  # under CP the GDN layers run the kernel of --gdn-kernel (at cp 1 the model's own layers)
        kernel = resolve_kernel(config.gdn_kernel, platform=platform)
        lines[0] += f"; GDN kernel {kernel.name} ({kernel.reason})"
    replicas = world_size // tp
    if config.batch_size % replicas == 0:
        fewer = f"--cp-size 1 ({replicas} data-parallel replicas, whole sequences per rank)"
    else:
        fewer = "fewer ranks per CP group (--cp-size) or fewer processes"
    advice = cp_advice(
        model_config=model_config,
        seq_len=config.seq_len,
        cp=cp,
        mode=mode,
        layout=config.token_layout(),
        device=platform,
        fewer=fewer,
        dtype="bfloat16" if config.dtype == "bf16" else "float32",
        inner_size=config.cp_inner_size,
        tp=tp,
    )
    return lines if advice is None else [*lines, advice]
