"""Every CP mode on real process groups, one process per device, against the one-device layer:
``scripts/device_check.py --multi`` (NCCL over the visible GPUs; ``--multi --smoke``: gloo ranks
on this CPU, tiny shapes, the same code).

Each rank builds the same layer and the same whole sequence (seeded), runs the one-device layer
on all of it (the reference), then for each mode and layout applies CP to a copy, runs its shard
forward and backward, and compares: the output shard and the input gradient shard against the
reference's, every parameter gradient summed over the ranks against the reference's (relative
error, max |a - b| / max |b|); and times the CP layer's forward+backward (median, after a
warm-up). Rank 0 returns the figures.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from benchkit.device_figures import relative, timed

MULTI_FULL = {"t": 16384, "hidden": 2048, "k_heads": 16, "v_heads": 32, "head_dim": 128, "repeats": 3,
              "dtype": "bfloat16"}  # fmt: skip
MULTI_SMOKE = {
    "t": 64,
    "hidden": 32,
    "k_heads": 4,
    "v_heads": 8,
    "head_dim": 8,
    "repeats": 1,
    "dtype": "float64",
}


def multi_cases(cfg: dict, cp: int) -> list[tuple[str, int | None, str]]:
    """(mode, inner_size, layout) for cp ranks: the one-level modes (the head modes where the
    value heads divide), the two-level ones with inner 2 (contiguous) when cp >= 4."""
    from hyperpar_gdn.planning.plan import HEAD_MODES, LAYOUTS, MODES, TWO_LEVEL_MODES

    cases = [
        (m, None, layout)
        for m in MODES
        for layout in LAYOUTS
        if m not in HEAD_MODES or (cfg["v_heads"] % cp == 0 and cfg["k_heads"] % cp == 0)
    ]
    if cp >= 4 and cp % 2 == 0:
        cases += [(m, 2, "contiguous") for m in TWO_LEVEL_MODES]
    return cases


def multi_worker(rank: int, world: int, cfg: dict) -> dict[str, Any] | None:
    """One rank's part (the process group is joined): figures per case, on rank 0."""
    from hyperpar_gdn import init_device_mesh
    from hyperpar_gdn.distributed.layout import TokenLayout
    from hyperpar_gdn.distributed.linear_attention_style import LinearAttentionContextParallel
    from hyperpar_gdn.models import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    device, dtype = platform.device, getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    module = GatedDeltaNet(cfg["hidden"], cfg["k_heads"], cfg["v_heads"], cfg["head_dim"], cfg["head_dim"])
    module = module.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x, cot = (
        torch.randn(1, cfg["t"], cfg["hidden"], generator=gen).to(device=device, dtype=dtype)
        for _ in range(2)
    )
    ref = copy.deepcopy(module)
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * cot).sum().backward()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    out: dict[str, Any] = {}
    for mode, inner, layout in multi_cases(cfg, world):
        index = torch.as_tensor(
            TokenLayout.of(layout, [cfg["t"] // world] * world).positions(rank), device=device
        )
        layer = LinearAttentionContextParallel(mode, inner_size=inner, layout=layout).apply(
            copy.deepcopy(module), mesh
        )

        def step(layer=layer, index=index) -> tuple[torch.Tensor, torch.Tensor]:
            xi = x[:, index].clone().requires_grad_(True)
            y = layer(xi)
            (y * cot[:, index]).sum().backward()
            return y, xi.grad

        layer.zero_grad(set_to_none=True)
        y, dx = step()
        grads = {n: p.grad.detach().clone().contiguous() for n, p in layer.named_parameters()}
        errors = {"output": relative(y, y_ref[:, index]), "dx": relative(dx, x_ref.grad[:, index])}
        ref_grads = dict(ref.named_parameters())
        for name, g in grads.items():
            total = platform.collectives.all_reduce_sum(g, mesh.get_group())
            errors[f"d{name}"] = relative(total, ref_grads[name].grad)
        seconds = timed(lambda step=step: step(), device, cfg["repeats"])["median_s"]
        key = f"{mode}/{layout}" + ("" if inner is None else f"/inner={inner}")
        out[key] = {"errors": errors, "worst_error": max(errors.values()), "layer_s": seconds}
    return out if rank == 0 else None
