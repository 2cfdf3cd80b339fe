"""``bench_stages``'s measurement: one GDN layer of a state mode at cp ranks, stage by stage.

The layer's context-parallel forward (:func:`hyperpar_gdn.distributed.cp.state_passing.
state_passing_forward` with :func:`hyperpar_gdn.ops.gdn.onepass.shard_outputs`) is cut into the
stages below; each runs on the inputs that the stage before it produced in one untimed trace, and
every stage's forward and backward are timed separately (a barrier before each, the device
synchronised around it) in alternating rounds. Stages:

- ``projections``: the four input projections of the shard;
- ``conv_halo``: the causal conv + SiLU with its halo from the previous fragment's owner (a
  shift for contiguous shards, an all-gather of the fragments' halos for head_tail);
- ``layout_reorder`` (head_tail): the fragments split into batch rows and the outputs joined back;
- ``chunk_prep``: heads, gates and the state-independent chunk quantities;
- ``summary``: the widened pass ``[S | M]`` and Q_eff (ranks that a state enters); backward
  ``dS_in = Q_eff^T do``;
- ``exchange``: the mode's exchange of summaries for S_in; backward its reverse;
- ``correction``: the plain chunk pass entered by S_in (outputs and true states); backward the
  reverse state loop;
- ``finish``: gated norm and output projection.

``layer`` is the whole layer's step (forward, backward) for comparison with the stages' sum, and
the stages' output is checked against the layer's (``max_abs_diff``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from benchkit.cp_layer import LayerShape
from benchkit.timing import alternating_rounds

__all__ = ["STAGES", "measure_stages", "summary_flops"]

STAGES = (
    "projections",
    "conv_halo",
    "layout_reorder",
    "chunk_prep",
    "summary",
    "exchange",
    "correction",
    "finish",
)


def summary_flops(
    shape: LayerShape, *, local_len: int, chunk_size: int, cp: int, mode: str
) -> dict[str, int]:
    """FLOPs that the state modes add to a shard's plain pass (one rank that a state enters),
    per forward and backward. Per token and head the widened pass carries K more state columns:
    ``vn_M = -w S_M`` and ``S_M <- gl S_M + kd^T vn_M`` (4 K^2), then
    ``Q_eff = qg S_M + P vn_M`` (2 K^2 + 2 C K); the backward's ``dS_in = Q_eff^T do`` is
    2 K V. The exchange composes ``M S_in`` (2 K^2 V per head) once per hop (p2p: one; the
    all-gather fold: up to cp - 1; the scan: ceil(log2 cp) rounds of a K^3 and a K^2 V product)."""
    s = shape
    k, v, heads = s.head_k_dim, s.head_v_dim, s.batch * s.num_v_heads
    tokens = heads * local_len
    hops = {"p2p": 1, "all_gather": cp - 1, "scan": max(1, (cp - 1).bit_length())}[mode]
    per_hop = heads * (2 * k * k * v + (2 * k**3 if mode == "scan" else 0))
    return {
        "summary_forward": tokens * (6 * k * k + 2 * chunk_size * k),
        "summary_backward": tokens * 2 * k * v,
        "exchange_forward": hops * per_hop,
        "exchange_backward": hops * per_hop,
    }


def _autograd_stage(fn: Callable[..., Any], inputs: tuple[Any, ...], sync: Callable[[], None]) -> tuple:
    """(forward call, backward call, the trace's outputs) of a stage that autograd differentiates:
    fresh leaves for ``inputs``, fixed random output gradients."""
    import torch

    leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    first = fn(*leaves)
    outs = first if isinstance(first, tuple) else (first,)
    grads = [torch.randn_like(y) for y in outs]
    live: dict[str, Any] = {}

    def forward() -> None:
        y = fn(*leaves)
        live["y"] = y if isinstance(y, tuple) else (y,)
        sync()

    def backward() -> None:
        ys = live.pop("y")
        pairs = [(y, g) for y, g in zip(ys, grads, strict=True) if y.requires_grad]
        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        for leaf in leaves:
            leaf.grad = None
        sync()

    return forward, backward, tuple(y.detach() for y in outs)


def _trace(layer: Any, cp: Any, x: Any, mode: str, layout: Any, chunk_size: int, sync: Callable) -> tuple:
    """Cut the layer's CP forward into stages (see the module docstring); ({stage: (forward,
    backward)}, the output ``[B, T_r, hidden]`` the stages compute). One function so that the
    pipeline reads top to bottom as in state_passing_forward."""
    import torch

    from hyperpar_gdn.distributed.cp.common import conv_fragments, conv_with_halo
    from hyperpar_gdn.distributed.cp.state_passing import EXCHANGES
    from hyperpar_gdn.ops import prepare_chunks
    from hyperpar_gdn.ops.gdn.common import to_chunks
    from hyperpar_gdn.ops.gdn.layer import (
        LayerDims,
        LayerWeights,
        finish,
        gates,
        head_dims,
        project,
        split_heads,
    )
    from hyperpar_gdn.ops.gdn.recurrence import forward_states, outputs_backward, outputs_forward

    xp, w, dims = cp.xp, LayerWeights.of(layer), LayerDims.of(layer)
    stages: dict[str, tuple[Callable, Callable]] = {}
    fwd, bwd, (mixed, z, b, a) = _autograd_stage(lambda x_: project(xp, w, x_), (x,), sync)
    stages["projections"] = (fwd, bwd)
    fragments = layout is not None
    if fragments:
        mine = layout.mine(cp.rank)
        lengths, n = [f.length for f in mine], len(mine)

        def rows(y: Any) -> Any:  # [B, T_r, *] -> [n*B, P, *], slot-major
            return xp.cat(xp.split(y, lengths, 1), 0)

        def conv(mixed_: Any) -> Any:
            return xp.cat(conv_fragments(cp, layout, xp.split(mixed_, lengths, 1), w.conv), 0)

        fwd, bwd, (conv_out,) = _autograd_stage(conv, (mixed,), sync)
    else:
        fwd, bwd, (conv_out,) = _autograd_stage(lambda m_: conv_with_halo(cp, m_, w.conv), (mixed,), sync)
    stages["conv_halo"] = (fwd, bwd)
    if fragments:
        fwd, bwd, (b, a) = _autograd_stage(lambda b_, a_: (rows(b_), rows(a_)), (b, a), sync)
        stages["layout_reorder"] = (fwd, bwd)

    def prep_of(conv_: Any, b_: Any, a_: Any) -> Any:
        q, k, v = split_heads(xp, conv_, **head_dims(dims))
        g, beta = gates(xp, b_, a_, w.a_log, w.dt_bias)
        return prepare_chunks(q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True)

    prep = prep_of(conv_out, b, a)
    fwd, bwd, (qg, p, u, ww, kd, gl) = _autograd_stage(
        lambda *t: (lambda pr: (pr.qg, pr.p, pr.u, pr.w, pr.kd, pr.gl))(prep_of(*t)), (conv_out, b, a), sync
    )
    stages["chunk_prep"] = (fwd, bwd)
    widened = fragments or cp.rank > 0
    _, bb, h, _, dv = u.shape
    dk = ww.shape[-1]
    found: dict[str, Any] = {}

    def summary() -> None:
        u_wide = xp.cat([u, xp.zeros((*u.shape[:-1], dk), like=u)], -1)
        eye = xp.eye(dk, like=u).reshape(1, 1, 1, dk, dk) + xp.zeros((1, bb, h, dk, dk), like=u)
        entry = xp.cat([xp.zeros((1, bb, h, dk, dv), like=u), eye], -1)
        states, vn, exits = forward_states(xp, u_wide, ww, kd, gl, entry, flush=True)
        found["q_eff"] = xp.matmul(qg, states[..., dv:]) + xp.matmul(p, vn[..., dv:])
        found["s_ext"], found["m"] = exits[0][..., :dv], exits[0][..., dv:]
        sync()

    do = torch.randn(bb, prep.seq_len, h, dv, dtype=u.dtype)

    def summary_backward() -> None:
        q_eff = found["q_eff"]
        found["ds_in"] = xp.sum(xp.matmul(xp.swapaxes(q_eff, -1, -2), to_chunks(xp, do, q_eff.shape[3])), 0)
        sync()

    exchange = EXCHANGES[mode](cp, layout)
    zero_in = xp.zeros((1, bb, h, dk, dv), like=u)
    if widened:
        summary()
        summary_backward()
        stages["summary"] = (summary, summary_backward)
    else:  # the first shard: its exchange gets the plain pass's final state
        (_, exits), _ = outputs_forward(xp, qg, p, u, ww, kd, gl, zero_in, seq_len=prep.seq_len)
        found.update(s_ext=exits[0], m=None, ds_in=None)

    def exchange_forward() -> None:
        found["s_in"] = exchange.forward(found["s_ext"], found["m"])
        sync()

    def exchange_backward() -> None:
        found["ds_out"] = exchange.backward(found["ds_in"])
        sync()

    exchange_forward()
    exchange_backward()
    stages["exchange"] = (exchange_forward, exchange_backward)
    entering = found["s_in"].reshape((1, *found["s_in"].shape)) if widened else zero_in

    def correction() -> None:
        (found["o"], _), found["saved"] = outputs_forward(
            xp, qg, p, u, ww, kd, gl, entering, seq_len=prep.seq_len
        )
        sync()

    def correction_backward() -> None:
        outputs_backward(xp, found.pop("saved"), do, found["ds_out"].reshape((1, *found["ds_out"].shape)))
        sync()

    correction()
    o = xp.cast(found["o"], prep.out_dtype)
    correction_backward()
    stages["correction"] = (correction, correction_backward)
    if fragments:

        def join(o_: Any) -> Any:
            return xp.cat(xp.split(o_, [o_.shape[0] // n] * n, 0), 1)

        fwd, bwd, (o,) = _autograd_stage(join, (o,), sync)
        reorder_fwd, reorder_bwd = stages["layout_reorder"]
        stages["layout_reorder"] = (lambda: (reorder_fwd(), fwd()), lambda: (reorder_bwd(), bwd()))
    fwd, bwd, (y,) = _autograd_stage(lambda o_, z_: finish(xp, w, dims, o_, z_), (o, z), sync)
    stages["finish"] = (fwd, bwd)
    return stages, y


def measure_stages(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank: every stage's forward and backward times (``{stage/fwd: [...], ...}``), the whole
    layer's, and the largest difference between the stages' output and the layer's."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.distributed.cp.common import CPGroup
    from hyperpar_gdn.distributed.layout import TokenLayout
    from hyperpar_gdn.models import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    shape = LayerShape(**job["shape"])
    mesh = init_device_mesh(platform.name, (cp,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    layer = GatedDeltaNet(*shape.args)
    style = LinearAttentionContextParallel(
        mode=job["mode"], layout=job["layout"], chunk_size=job["chunk_size"]
    )
    cp_layer = style.apply(GatedDeltaNet(*shape.args), mesh)
    cp_layer.load_state_dict(layer.state_dict())
    local_len = job["seq_len"] // cp
    x = torch.randn(shape.batch, local_len, shape.hidden, generator=torch.Generator().manual_seed(rank))
    tokens = TokenLayout.of(job["layout"], [local_len] * cp)
    on_gpu = x.is_cuda
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    group = CPGroup.of(mesh)
    stages, y = _trace(
        layer, group, x, job["mode"], None if tokens.is_contiguous else tokens, job["chunk_size"], sync
    )
    x_layer = x.clone().requires_grad_(True)
    with torch.no_grad():
        diff = float((cp_layer(x_layer) - y).abs().max())
    calls: dict[str, Callable[[], Any] | None] = {}
    for name in STAGES:  # the same names on every rank: a stage a rank lacks only waits
        if name != "layout_reorder" or not tokens.is_contiguous:
            calls[f"{name}/fwd"], calls[f"{name}/bwd"] = stages.get(name, (None, None))

    def layer_step() -> None:
        cp_layer.zero_grad(set_to_none=True)
        cp_layer(x_layer).sum().backward()
        sync()

    calls["layer"] = layer_step
    barrier = platform.collectives.barrier
    times = alternating_rounds(
        calls, repeats=job["repeats"], warmup=job["warmup"], barrier=lambda: barrier(None)
    )
    return {
        "rank": rank,
        "max_abs_diff": diff,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "times_s": times,
    }
