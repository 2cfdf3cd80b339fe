"""msrun sections for the two-level CP modes in the head_tail layout (MindSpore, 8 workers).

``two_level_head_tail``: the MindSpore GDN layer under ``ulysses+<state mode>`` with
``layout="head_tail"`` (rank r holds pieces r and 2cp-1-r of 2cp) on cp = 8 as 2 nodes of 4 and
4 nodes of 2, float32, packed documents that cross pieces, ranks and nodes: the output shard, the
input-gradient shard and every parameter gradient summed over the ranks, against the MindSpore
layer on one device (same weights, the whole packed row) and the float64 torch layer on each
document alone. Run by ``tests/distributed/msrun_cp_worker.py`` (its job of 8 workers); asserted
in tests/distributed/test_context_parallel_two_level_mindspore.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.verify import relative_error
from hyperpar_gdn.platform import Platform

HIDDEN, T = 32, 96  # 12 tokens per rank at cp 8, pieces of 6
# (mode, inner_size, documents or None); nodes of 4: the outer pieces are 24 tokens long
CASES = (
    ("ulysses+p2p", 4, (0, 11, 40, 96)),
    ("ulysses+scan", 2, (0, 5, 19, 20, 33, 50, 71, 96)),
    ("ulysses+all_gather", 2, None),
)


def torch_gdn(dtype: str) -> Any:
    """The torch layer (q/k heads 2, value heads 4), seeded, every parameter moved off its init."""
    import torch

    from hyperpar_gdn.models import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, 2, 4, 16, 8)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.to(getattr(torch, dtype))


def torch_per_document(layer: Any, x: np.ndarray, cot: np.ndarray, cu: Any) -> dict[str, np.ndarray]:
    """Output, input gradient (``[1, T, hidden]``) and parameter gradients of the torch layer run on
    each document of ``cu`` alone (the whole row when ``cu`` is None), float64."""
    import torch

    bounds = [0, x.shape[1]] if cu is None else list(cu)
    got: dict[str, Any] = {"output": [], "dx": []}
    layer.zero_grad()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        xt = torch.tensor(x[:, a:b], dtype=torch.float64, requires_grad=True)
        out = layer(xt)
        out.backward(torch.tensor(cot[:, a:b], dtype=torch.float64))
        got["output"].append(out.detach().numpy())
        got["dx"].append(xt.grad.numpy())
    result = {key: np.concatenate(parts, 1) for key, parts in got.items()}
    result.update({name: p.grad.numpy().copy() for name, p in layer.named_parameters()})
    return result


def _run(platform: Platform, layer: Any, x: np.ndarray, cot: np.ndarray, cu: Any) -> dict[str, Any]:
    out, (dx,), grads = platform.value_and_grads(
        lambda inp: layer(inp, cu_seqlens=None if cu is None else np.asarray(cu)),
        [platform.from_numpy(x, dtype="float32")],
        platform.from_numpy(cot, dtype="float32"),
        layer,
    )
    return {"output": out, "dx": dx, **grads}


def section_two_level_head_tail(platform: Platform, world: int) -> dict[str, Any]:
    """Per case ``{mode}-inner{n}``: the relative errors (each tensor's max abs error over its max
    abs value) against the one-device MindSpore layer (``vs_single``) and the float64 torch layer
    per document (``vs_truth``), and the one-device layer's own distance to that truth."""
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rank, group, comm = mesh.get_local_rank(), mesh.get_group(), platform.collectives
    layer_t = torch_gdn("float32")
    truth_layer = torch_gdn("float64")
    index = TokenLayout.of("head_tail", [T // world] * world).positions(rank)
    results: dict[str, Any] = {"positions": [int(i) for i in np.asarray(index)]}
    for case, (mode, inner, cu) in enumerate(CASES):
        rng = np.random.default_rng(case)
        x, cot = rng.standard_normal((1, T, HIDDEN)), rng.standard_normal((1, T, HIDDEN))
        truth = torch_per_document(truth_layer, x, cot, cu)
        single = {
            k: platform.to_numpy(v)
            for k, v in _run(platform, GatedDeltaNet.from_torch(layer_t), x, cot, cu).items()
        }
        style = LinearAttentionContextParallel(mode, chunk_size=4, inner_size=inner, layout="head_tail")
        layer = style.apply(GatedDeltaNet.from_torch(layer_t), mesh)
        got = _run(platform, layer, x[:, index], cot[:, index], cu)
        cp_run = {
            k: platform.to_numpy(v if k in ("output", "dx") else comm.all_reduce_sum(v, group))
            for k, v in got.items()
        }

        def errors(actual: dict[str, np.ndarray], reference: dict[str, np.ndarray], local: Any) -> dict:
            return {
                k: relative_error(v, reference[k][:, local] if k in ("output", "dx") else reference[k])
                for k, v in actual.items()
            }

        results[f"{mode}-inner{inner}"] = {
            "vs_single": errors(cp_run, single, index),
            "vs_truth": errors(cp_run, truth, index),
            "single_vs_truth": errors(single, truth, slice(None)),
        }
    return results
