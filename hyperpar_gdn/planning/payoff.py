"""Whether context parallelism pays at a run's sequence length: a note for a run's header,
computed from the cost model (:mod:`.cost_model`) with the machine's figures.

Per GDN layer, one device runs the gated delta rule on the whole sequence of T tokens; at cp ranks
each rank runs it on its T/cp tokens and adds its mode's exchanges and extra work
(:attr:`~.cost_model.ModeCost.seconds`). CP pays when the rule work it takes off a rank,
``(1 - 1/cp)`` of one device's, exceeds what the mode adds. The figures are the device kind's
:data:`~.cost_model.MACHINES` entry (cpu: gloo on one host as ``scripts/bench_scale.py`` measures
it; gpu, npu: published orders of magnitude), or the caller's (``bandwidth=``, ``latency=``,
``flops=``, ... as :func:`~.ranking.plan_context_parallel` takes them).

Left out, as in the cost model: the projections, norms and MLPs (cut by cp in every mode, so CP
gains there too), the softmax-attention layers, and an eager framework's fixed cost per operation,
which CP does not cut: a small model gains later than predicted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.planning.plan import SPECS
from hyperpar_gdn.planning.ranking import MACHINES, machine_kind, plan_context_parallel

__all__ = ["CPPayoff", "cp_advice", "cp_payoff"]

LONGEST = 1 << 24  # the break-even search stops here (16M tokens per sequence)
_DIMS = {  # plan_context_parallel's keyword: the model config's key (HybridLMConfig and Qwen3.5 alike)
    "num_k_heads": "linear_num_key_heads",
    "num_v_heads": "linear_num_value_heads",
    "head_k_dim": "linear_key_head_dim",
    "head_v_dim": "linear_value_head_dim",
    "conv_kernel_size": "linear_conv_kernel_dim",
    "hidden_size": "hidden_size",
}


@dataclass(frozen=True)
class CPPayoff:
    """The cost model's verdict for one sequence length, per GDN layer and rank (forward + backward).

    Attributes:
        speedup: one device's rule seconds over a CP rank's (its shard's rule plus the mode's cost).
        added_s: seconds the mode adds (exchanges, extra work); saved_s: rule seconds CP takes off.
        break_even: the shortest sequence (T doubled from the run's) at which ``speedup`` exceeds 1,
            or None when none up to :data:`LONGEST` does.
        figures: the machine's figures, in words.
    """

    speedup: float
    added_s: float
    saved_s: float
    break_even: int | None
    figures: str


def _gdn_dims(model_config: Mapping[str, Any]) -> dict[str, int]:
    """plan_context_parallel's layer keywords from a model's config dict (``to_dict()`` of
    ``HybridLMConfig`` or a transformers Qwen3.5 config; a multimodal one's ``text_config``)."""
    config = model_config.get("text_config") or model_config
    missing = [key for key in _DIMS.values() if config.get(key) is None]
    if missing:
        raise ValueError(f"cp_payoff: the model config has no {', '.join(missing)}: not a GDN model's config")
    return {name: int(config[key]) for name, key in _DIMS.items()}


def cp_payoff(
    *,
    model_config: Mapping[str, Any],
    seq_len: int,
    cp: int,
    mode: str,
    layout: str,
    device: str,
    dtype: str = "float32",
    batch: int = 1,
    inner_size: int | None = None,
    tp: int = 1,
    **machine: float,
) -> CPPayoff:
    """The cost model's :class:`CPPayoff` of ``mode`` for sequences of ``seq_len`` tokens over ``cp`` ranks.

    Args:
        model_config: the model's config dict (the GDN heads, head dims, conv width, hidden size).
        seq_len: tokens T of one sequence (the whole sequence, before the CP split).
        cp: ranks of the CP group; mode: a CP mode (two-level ones with ``inner_size``).
        layout: the token layout; device: the mesh's device type (``"cpu"``, ``"cuda"``, ``"npu"``;
            other names take the cpu figures).
        dtype: the activations' dtype name (``"float32"``, ``"bfloat16"``); batch: rows B.
        tp: tensor-parallel ranks: CP runs on a TP rank's heads (TP's own all-reduces are paid
            with or without CP and are not counted against it).
        machine: figures that replace the device kind's (``bandwidth``, ``latency``, ``flops``, ...).
    """
    kind = device if device in MACHINES else machine_kind(device)
    dims = _gdn_dims(model_config)

    def at(t: int) -> tuple[float, float]:
        """(the shard's rule seconds, the seconds the mode adds) at T = t."""
        ranked = plan_context_parallel(
            seq_len=t, cp=cp, dtype=dtype, layout=layout, device=kind, batch=batch, inner_size=inner_size,
            tp=tp, modes=[mode], **dims, **machine,
        )  # fmt: skip
        cost = ranked.ranking[0]
        if not cost.feasible:
            raise ValueError(f"cp_payoff: {cost.describe()}")
        return cost.shared_seconds, cost.seconds

    shard, added = at(seq_len)
    break_even, t = None, seq_len
    while cp > 1 and t <= LONGEST:
        t_shard, t_added = at(t)
        if (cp - 1) * t_shard > t_added:  # the work split off exceeds what the mode adds
            break_even = t
            break
        t *= 2
    speedup = cp * shard / (shard + added)
    saved = (cp - 1) * shard
    figures = _figures(kind, machine)
    return CPPayoff(speedup=speedup, added_s=added, saved_s=saved, break_even=break_even, figures=figures)


def _figures(kind: str, machine: Mapping[str, float]) -> str:
    base = MACHINES[kind]
    link = base.intra
    bandwidth = machine.get("bandwidth", link.bandwidth)
    latency = machine.get("latency", link.latency)
    flops = machine.get("flops", base.flops)
    return f"{kind}: {bandwidth / 1e9:g} GB/s, {latency * 1e6:g} us per message, {flops / 1e9:g} GFLOP/s"


def cp_advice(
    *,
    model_config: Mapping[str, Any],
    seq_len: int,
    cp: int,
    mode: str,
    layout: str,
    device: str,
    fewer: str,
    dtype: str = "float32",
    inner_size: int | None = None,
    tp: int = 1,
    **machine: float,
) -> str | None:
    """One line for a run header when the cost model predicts that CP does not pay at ``seq_len``
    tokens per sequence, else None (and None at cp=1). ``fewer``: how the script runs on fewer
    ranks (an option or a launcher setting), named in the line. The other arguments are
    :func:`cp_payoff`'s; a layout-dependent mode also names the contiguous layout when the model
    predicts it cheaper."""
    if cp < 2 or (SPECS[mode].two_level and inner_size is None):
        return None  # no CP, or a two-level mode whose inner size the caller did not say
    common = dict(
        model_config=model_config, seq_len=seq_len, cp=cp, mode=mode, device=device, dtype=dtype, tp=tp
    )
    payoff = cp_payoff(**common, layout=layout, inner_size=inner_size, **machine)
    if payoff.speedup >= 1:
        return None
    where = (
        f"a gain from about {payoff.break_even:,} tokens per sequence"
        if payoff.break_even is not None
        else f"no gain up to {LONGEST:,} tokens per sequence"
    )
    line = (
        f"note: CP does not pay at {seq_len:,} tokens per sequence over cp={cp}: the cost model "
        f"({payoff.figures}) puts {_seconds(payoff.added_s)} of {mode} exchanges per GDN layer against "
        f"{_seconds(payoff.saved_s)} of work split off; {where}; faster here: {fewer}"
    )
    if layout != "contiguous":
        contiguous = cp_payoff(**common, layout="contiguous", inner_size=inner_size, **machine)
        if contiguous.added_s < payoff.added_s:
            line += f", or the contiguous layout ({_seconds(contiguous.added_s)} of exchanges)"
    return line


def _seconds(value: float) -> str:
    return f"{value * 1e6:.3g} us" if value < 1e-3 else f"{value * 1e3:.3g} ms"
