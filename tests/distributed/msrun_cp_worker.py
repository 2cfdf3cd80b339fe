"""msrun worker for the MindSpore tests: one job per world size runs every section and case.

Launched by ``tests/msrun_harness.run_msrun`` (``msrun --worker_num=N ... msrun_cp_worker.py
--sections collectives cp bad_input mesh2d``); each rank writes ``{"rank", "world", "sections":
{name: {"ok", "seconds", "data" or "error"}}}`` after every section. The pytest modules assert:

- ``collectives`` (tests/platform/test_mindspore_platform.py): raw values and gradients of every
  differentiable collective, ``send``/``recv``, ``all_reduce_sum``, byte counts, subgroups;
- ``cp`` (tests/distributed/test_context_parallel_mindspore.py): on the mesh of
  ``init_device_mesh("cpu", ...)`` (MindSpore under ``HP_PLATFORM=mindspore``), every mode on every
  case against the single-device MindSpore layer and the torch layer with the same weights (output
  shard, input-gradient shard, parameter gradients summed over ranks);
- ``packed``: packed documents (global ``cu_seqlens``), every mode, against the torch layer run on
  each document alone (float64);
- ``attention`` (tests/distributed/test_softmax_attention_style_mindspore.py): the MindSpore
  ``CausalSelfAttention`` under ``SoftmaxAttentionContextParallel`` with uneven shards and packed
  documents against the torch layer (float64);
- ``bad_input``: the (type, message) of each bad call on every rank, compared with torch's;
- ``mesh2d`` (4 workers): CP along the ``cp`` axis of a (dp=2, cp=2) mesh, through
  ``hyperpar_gdn.distributed.verify.compare_with_reference``;
- ``prefill`` (2 and 4 workers, tests/inference/test_prefill_mindspore.py): the MindSpore Qwen3.5
  model (dense and MoE) reads a prompt under every mode (scan included); the states equal the
  single-device prefill's and the greedy continuation from them equals its continuation (every
  mode for dense, p2p for MoE); the dense model's states in the head_tail layout too;
- ``cp_decoding`` (tests/inference/test_decoding_cp_mindspore.py): after a CP prefill of the
  MindSpore Qwen3.5 model, greedy decoding on the CP group with the K/V cache sharded, against the
  single-device greedy continuation; the K/V tokens each rank keeps; the refusals;
- ``lm_loss`` (tests/distributed/test_batch.py): ``context_parallel_lm_loss`` on each rank's
  shard of :func:`lm_loss_inputs` (float64), the loss and the gradients of the hidden-state shard
  and of the head weight;
- ``grads`` (4 workers, tests/distributed/test_grads.py): ``sync_context_parallel_grads`` on a
  (dp=2, cp=2) mesh, MindSpore gradient tensors of rank-dependent values;
- ``scan`` (4 workers, tests/distributed/test_context_parallel_scan_mindspore.py): ``mode="scan"``
  with uneven shards and head_tail, packed documents, against the torch layer per document
  (float64), and the shapes of this rank's sends;
- ``cpu_share`` (tests/platform/test_mindspore_cpu_share.py, after the sections that ran
  kernels): what the platform set for this worker's CPU share, and the cores every thread of the
  process (MindSpore's kernel pool included) may run on;
- ``tp_layers``, ``tp_model``, ``tp_bad_input`` (4 workers, tests/tensor_parallel/test_mindspore_styles.py,
  :mod:`msrun_tp_sections`): tensor parallelism of the GDN layer and the attention on a (cp, tp)
  mesh;
- ``two_level_head_tail`` (8 workers, tests/distributed/test_context_parallel_two_level_mindspore.py,
  :mod:`msrun_two_level_sections`): the two-level modes in the head_tail layout (float32);
- ``stall`` (last): the last rank never joins a collective; the others must fail on their own
  within the communication timeout with a ``CollectiveError``.

The functions :func:`torch_layer`, :func:`case_inputs` and :func:`bad_input_checks` are also used
by the pytest side (they name no framework-specific launcher).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for msrun_harness

from msrun_harness import GDN_PARAMS as PARAMS  # noqa: E402
from msrun_harness import start_watchdog, write_result  # noqa: E402
from msrun_tp_sections import section_tp_bad_input, section_tp_layers, section_tp_model  # noqa: E402
from msrun_two_level_sections import section_two_level_head_tail  # noqa: E402

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh  # noqa: E402
from hyperpar_gdn.distributed.verify import compare_with_reference, relative_error  # noqa: E402
from hyperpar_gdn.planning.plan import HEAD_MODES  # noqa: E402
from hyperpar_gdn.platform import Platform, get_platform  # noqa: E402

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")
SECTIONS = (
    "collectives",
    "cp",
    "packed",
    "attention",
    "bad_input",
    "mesh2d",
    "grads",
    "lm_loss",
    "prefill",
    "cp_decoding",
    "scan",
    "cpu_share",
    "two_level_head_tail",
    "tp_layers",
    "tp_model",
    "tp_bad_input",
    "stall",
)
HIDDEN = 32


@dataclass(frozen=True)
class Case:
    num_k_heads: int
    num_v_heads: int
    seq_len: int
    masked: bool = False
    dtype: str = "float32"
    uneven: bool = False  # shards of different lengths (UNEVEN_SHARDS), else T/cp each

    def __str__(self) -> str:
        uneven = "-uneven" if self.uneven else ""
        return f"Hk{self.num_k_heads}-H{self.num_v_heads}-T{self.seq_len}{'-mask' if self.masked else ''}-{self.dtype}{uneven}"


# The torch CP test's cases (tests/distributed/test_context_parallel.py) less bf16, which MindSpore
# cannot run on CPU (no bf16 matmul kernel), plus a float64 case that must agree to rounding.
CASES = (
    Case(4, 4, 96),  # local T 48 or 24: not a multiple of the 64 chunk
    Case(2, 4, 200),  # GQA, T/cp = 100 or 50; at cp=4 ulysses gives ranks 0 and 1 the same q/k head
    Case(4, 8, 160, masked=True),  # padding mask
    Case(4, 4, 64, dtype="float64"),
    Case(2, 4, 100, dtype="float64", uneven=True),  # uneven all-to-all splits, 3-token shards
)
UNEVEN_SHARDS = {100: {2: (29, 71), 4: (3, 40, 54, 3)}}


def shard_bounds(case: Case, world: int, rank: int) -> slice:
    """The tokens of ``rank``: T/cp each, or the case's uneven shard lengths."""
    lengths = UNEVEN_SHARDS[case.seq_len][world] if case.uneven else (case.seq_len // world,) * world
    start = sum(lengths[:rank])
    return slice(start, start + lengths[rank])


def ulysses_splits(case: Case, world: int) -> bool:
    """Ulysses needs the value heads divisible by cp (q/k heads follow their value heads)."""
    return case.num_v_heads % world == 0


def torch_layer(case: Case, hidden: int = HIDDEN) -> Any:
    """The torch layer of the torch CP tests: seeded, every parameter moved off its init."""
    import torch

    from hyperpar_gdn.models import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden, case.num_k_heads, case.num_v_heads, 16, 8)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.to(getattr(torch, case.dtype))


def case_inputs(case: Case, hidden: int = HIDDEN) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """x, cotangent ``[2, T, hidden]`` and the mask ``[2, T]`` (left and right padding) or None."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, case.seq_len, hidden))
    cot = rng.standard_normal((2, case.seq_len, hidden))
    mask = None
    if case.masked:
        mask = np.ones((2, case.seq_len))
        mask[0, :7] = 0
        mask[1, -30:] = 0
    return x, cot, mask


Triple = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]


def torch_reference(
    layer: Any, x: np.ndarray, cot: np.ndarray, mask: np.ndarray | None, dtype: str
) -> Triple:
    """Output, input gradient and parameter gradients of the torch layer on the whole sequence."""
    import torch

    tdtype = getattr(torch, dtype)
    xt = torch.tensor(x, dtype=tdtype, requires_grad=True)
    mt = None if mask is None else torch.tensor(mask, dtype=tdtype)
    layer.zero_grad()
    out = layer(xt, attention_mask=mt)
    out.backward(torch.tensor(cot, dtype=tdtype))
    grads = {name: p.grad.detach().numpy().copy() for name, p in layer.named_parameters()}
    return out.detach().numpy(), xt.grad.detach().numpy(), grads


def platform_run(
    platform: Platform, module: Any, x: np.ndarray, cot: np.ndarray, mask: np.ndarray | None, dtype: str
) -> tuple[Any, Any, dict[str, Any]]:
    """``platform.value_and_grads`` of ``module(x, attention_mask=mask)`` (platform tensors; any
    platform)."""
    mask_t = None if mask is None else platform.from_numpy(mask, dtype=dtype)
    out, (dx,), grads = platform.value_and_grads(
        lambda inp: module(inp, attention_mask=mask_t),
        [platform.from_numpy(x, dtype=dtype)],
        platform.from_numpy(cot, dtype=dtype),
        module,
    )
    return out, dx, grads


def _errors(actual: Triple, expected: Triple, local: slice) -> dict[str, float]:
    out, dx, grads = actual
    ref_out, ref_dx, ref_grads = expected
    errors = {
        "output": relative_error(out, ref_out[:, local]),
        "grad_input": relative_error(dx, ref_dx[:, local]),
    }
    for name in PARAMS:
        errors[f"grad_{name}"] = relative_error(grads[name], ref_grads[name])
    return errors


# --- sections -------------------------------------------------------------------------------------


def section_cp(platform: Platform, world: int) -> dict[str, Any]:
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))  # MindSpore under HP_PLATFORM
    rank, group = mesh.get_local_rank(), mesh.get_group()
    results: dict[str, Any] = {"mesh": [mesh.device_type, mesh.platform.name, mesh.platform is platform]}
    for case in CASES:
        layer_t = torch_layer(case)
        x, cot, mask = case_inputs(case)
        ref_t = torch_reference(layer_t, x, cot, mask, case.dtype)
        out, dx, grads = platform_run(platform, GatedDeltaNet.from_torch(layer_t), x, cot, mask, case.dtype)
        ref_m = (
            platform.to_numpy(out),
            platform.to_numpy(dx),
            {name: platform.to_numpy(g) for name, g in grads.items()},
        )
        results[f"{case}/single_device_vs_torch"] = _errors(ref_m, ref_t, slice(None))
        truth = ref_t
        if case.dtype != "float64":  # the float64 torch layer with the same weights: the truth
            truth_case = Case(case.num_k_heads, case.num_v_heads, case.seq_len, case.masked, "float64")
            truth = torch_reference(torch_layer(truth_case), x, cot, mask, "float64")
        results[f"{case}/single_device_vs_truth"] = _errors(ref_m, truth, slice(None))
        local = shard_bounds(case, world, rank)
        for mode in MODES:
            key = f"{case}/{mode}"
            if mode in HEAD_MODES and not ulysses_splits(case, world):
                results[key] = {"skipped": f"num_v_heads={case.num_v_heads} not divisible by {world}"}
                continue
            layer = LinearAttentionContextParallel(mode=mode).apply(GatedDeltaNet.from_torch(layer_t), mesh)
            platform.collectives.reset_bytes()
            start = time.perf_counter()
            out, dx, grads = platform_run(
                platform,
                layer,
                x[:, local],
                cot[:, local],
                None if mask is None else mask[:, local],
                case.dtype,
            )
            seconds = time.perf_counter() - start
            sent = platform.collectives.reset_bytes()
            totals = {
                name: platform.to_numpy(platform.collectives.all_reduce_sum(g, group))
                for name, g in grads.items()
            }
            cp_run = (platform.to_numpy(out), platform.to_numpy(dx), totals)
            results[key] = {
                "vs_mindspore": _errors(cp_run, ref_m, local),
                "vs_torch": _errors(cp_run, ref_t, local),
                "vs_truth": _errors(cp_run, truth, local),
                "grad_names": sorted(grads),
                "seconds": seconds,
                "bytes_sent": sent,
            }
    return results


# Packed documents (B = 1, float64): global boundaries; shards of 48 (cp 2) or 24 (cp 4) tokens.
PACKED_T = 96
# head_tail pieces start at multiples of 24 (cp 2) and 12 (cp 4): 10..60 and 60..93 cross several
HEAD_TAIL_CU = (0, 1, 10, 60, 93, 96)
PACKED_CASES = {
    "tiny-and-long": (0, 1, 3, 10, 60, 96),  # 1 and 2 tokens (< conv halo); 10..60 crosses 24 and 48
    "at-shard-start": (0, 48, 72, 96),
    "short-across": (0, 47, 49, 50, 96),
}


def section_packed(platform: Platform, world: int) -> dict[str, Any]:
    """Every mode on packed documents against the torch layer run on each document alone."""

    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    case = Case(2, 4, PACKED_T, dtype="float64")
    layer_t = torch_layer(case)
    rng = np.random.default_rng(3)
    x, cot = rng.standard_normal((1, PACKED_T, HIDDEN)), rng.standard_normal((1, PACKED_T, HIDDEN))
    local = slice(mesh.get_local_rank() * PACKED_T // world, (mesh.get_local_rank() + 1) * PACKED_T // world)
    results: dict[str, Any] = {}
    for name, cu in PACKED_CASES.items():
        pieces = [
            torch_reference(layer_t, x[:, a:b], cot[:, a:b], None, "float64")
            for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
        reference = (
            np.concatenate([p[0] for p in pieces], 1),
            np.concatenate([p[1] for p in pieces], 1),
            {k: sum(p[2][k] for p in pieces) for k in PARAMS},
        )
        for mode in MODES:
            layer = LinearAttentionContextParallel(mode=mode).apply(GatedDeltaNet.from_torch(layer_t), mesh)
            cu_t = np.asarray(cu)
            out, (dx,), grads = platform.value_and_grads(
                lambda inp, layer=layer, cu_t=cu_t: layer(inp, cu_seqlens=cu_t),
                [platform.from_numpy(x[:, local], dtype="float64")],
                platform.from_numpy(cot[:, local], dtype="float64"),
                layer,
            )
            totals = {
                k: platform.to_numpy(platform.collectives.all_reduce_sum(g, mesh.get_group()))
                for k, g in grads.items()
            }
            results[f"{name}/{mode}"] = _errors(
                (platform.to_numpy(out), platform.to_numpy(dx), totals), reference, local
            )
    results.update(_head_tail(platform, mesh, layer_t, x, cot))
    return results


def _head_tail(platform: Platform, mesh: Any, layer_t: Any, x: np.ndarray, cot: np.ndarray) -> dict[str, Any]:
    """The head_tail layout (rank r holds pieces r and 2cp-1-r of 2*cp), every mode, against the
    torch layer: packed documents across pieces (each document alone) and padding (chunk 8, so
    that every fragment spans several chunks)."""
    from hyperpar_gdn.distributed.layout import TokenLayout
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    world = mesh.size()
    local = TokenLayout.of("head_tail", [PACKED_T // world] * world).positions(mesh.get_local_rank())
    cu = HEAD_TAIL_CU
    pieces = [
        torch_reference(layer_t, x[:, a:b], cot[:, a:b], None, "float64")
        for a, b in zip(cu[:-1], cu[1:], strict=True)
    ]
    packed = (
        np.concatenate([p[0] for p in pieces], 1),
        np.concatenate([p[1] for p in pieces], 1),
        {k: sum(p[2][k] for p in pieces) for k in PARAMS},
    )
    mask = np.ones((1, PACKED_T))
    mask[0, :5] = 0
    mask[0, -30:] = 0
    padded = torch_reference(layer_t, x, cot, mask, "float64")
    results = {}
    for mode in MODES:
        for name, reference, packing in (("packed", packed, np.asarray(cu)), ("padded", padded, None)):
            style = LinearAttentionContextParallel(mode=mode, chunk_size=8, layout="head_tail")
            layer = style.apply(GatedDeltaNet.from_torch(layer_t), mesh)
            mask_t = None if packing is not None else platform.from_numpy(mask[:, local], dtype="float64")
            out, (dx,), grads = platform.value_and_grads(
                lambda inp, layer=layer, cu_t=packing, m=mask_t: layer(
                    inp, attention_mask=m, cu_seqlens=cu_t
                ),
                [platform.from_numpy(x[:, local], dtype="float64")],
                platform.from_numpy(cot[:, local], dtype="float64"),
                layer,
            )
            totals = {
                k: platform.to_numpy(platform.collectives.all_reduce_sum(g, mesh.get_group()))
                for k, g in grads.items()
            }
            results[f"head_tail/{name}/{mode}"] = _errors(
                (platform.to_numpy(out), platform.to_numpy(dx), totals), reference, local
            )
    return results


# Softmax attention under SoftmaxAttentionContextParallel: uneven shards, documents crossing them.
ATTENTION_T = 23
ATTENTION_SHARDS = {2: (9, 14), 4: (3, 8, 5, 7)}
ATTENTION_CU = (0, 2, 7, 8, 16, 23)


def section_attention(platform: Platform, world: int) -> dict[str, Any]:
    """The MindSpore CausalSelfAttention under SoftmaxAttentionContextParallel (uneven shards,
    packed documents, float64) against the torch layer with the same weights on one process, on
    the blockwise path and the dense reference (``HP_ATTENTION``)."""
    import torch

    from hyperpar_gdn import SoftmaxAttentionContextParallel
    from hyperpar_gdn.models.attention import CausalSelfAttention as TorchAttention
    from hyperpar_gdn.models.mindspore import CausalSelfAttention, load_torch_state_dict

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rank = mesh.get_local_rank()
    torch.manual_seed(0)
    layer_t = TorchAttention(HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8).double()
    with torch.no_grad():
        for p in layer_t.parameters():
            p.add_(0.1 * torch.randn_like(p))
    rng = np.random.default_rng(5)
    x, cot = rng.standard_normal((1, ATTENTION_T, HIDDEN)), rng.standard_normal((1, ATTENTION_T, HIDDEN))
    xt = torch.tensor(x, requires_grad=True)
    yt = layer_t(xt, cu_seqlens=torch.tensor(ATTENTION_CU))
    (yt * torch.tensor(cot)).sum().backward()
    lengths = ATTENTION_SHARDS[world]
    local = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
    results: dict[str, Any] = {"lengths": list(lengths)}
    for path in ("blockwise", "reference"):
        os.environ["HP_ATTENTION"] = path
        layer = CausalSelfAttention(HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8)
        load_torch_state_dict(layer, layer_t.state_dict())
        SoftmaxAttentionContextParallel().apply(layer, mesh)
        cu = np.asarray(ATTENTION_CU)
        out, (dx,), grads = platform.value_and_grads(
            lambda inp, layer=layer, cu=cu: layer(inp, cu_seqlens=cu),
            [platform.from_numpy(x[:, local], dtype="float64")],
            platform.from_numpy(cot[:, local], dtype="float64"),
            layer,
        )
        errors = {
            "output": relative_error(platform.to_numpy(out), yt.detach().numpy()[:, local]),
            "grad_input": relative_error(platform.to_numpy(dx), xt.grad.numpy()[:, local]),
        }
        for name, p in layer_t.named_parameters():
            total = platform.collectives.all_reduce_sum(grads[name], mesh.get_group())
            errors[f"grad_{name}"] = relative_error(platform.to_numpy(total), p.grad.numpy())
        results[path] = errors
    os.environ.pop("HP_ATTENTION")
    return results


def bad_input_checks(
    platform: Platform, mesh: Any, new_layer: Callable[[int, int], Any], hidden: int = HIDDEN
) -> dict[str, Any]:
    """Call the CP API wrongly, identically on every rank; return ``{check: [error type, message]}``
    and, last, ``in_step``: one all-gather of the ranks after the errors (every rank got there).

    ``new_layer(num_k_heads, num_v_heads)`` makes a fresh layer of this platform's framework."""
    cp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    rng = np.random.default_rng(0)

    def tensor(*shape: int) -> Any:
        return platform.from_numpy(rng.standard_normal(shape))

    outcomes: dict[str, Any] = {}

    def expect(name: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as exc:  # recorded and compared, not swallowed
            outcomes[name] = [type(exc).__name__, str(exc)]
        else:
            outcomes[name] = ["no error", ""]

    expect("unknown_mode", lambda: LinearAttentionContextParallel(mode="ring"))
    expect("chunk_size", lambda: LinearAttentionContextParallel(mode="p2p", chunk_size=0))
    expect(
        "ulysses_heads", lambda: LinearAttentionContextParallel(mode="ulysses").apply(new_layer(1, 3), mesh)
    )
    for mode in MODES:
        layer = LinearAttentionContextParallel(mode=mode).apply(new_layer(4, 4), mesh)
        expect(f"{mode}/hidden", lambda layer=layer: layer(tensor(2, 8, hidden + 1)))
        expect(f"{mode}/rank2", lambda layer=layer: layer(tensor(8, hidden)))
        expect(
            f"{mode}/mask_shape",
            lambda layer=layer: layer(
                tensor(2, 8, hidden), attention_mask=platform.from_numpy(np.ones((2, 9)))
            ),
        )
        if mode not in HEAD_MODES:
            expect(f"{mode}/shorter_than_halo", lambda layer=layer: layer(tensor(2, 2, hidden)))
        expect(
            f"{mode}/applied_twice",
            lambda mode=mode, layer=layer: LinearAttentionContextParallel(mode=mode).apply(layer, mesh),
        )
    expect(
        "all_to_all/split_count",
        lambda: platform.collectives.all_to_all(tensor(3, 2), [1] * (cp + 1), [1] * (cp + 1), group),
    )
    expect(
        "all_to_all/split_sum",
        lambda: platform.collectives.all_to_all(tensor(3, 2), [2] * cp, [2] * cp, group),
    )
    expect(
        "all_to_all/negative",
        lambda: platform.collectives.all_to_all(
            tensor(3, 2), [3 + cp - 1] + [-1] * (cp - 1), [1] * cp, group
        ),
    )
    expect("send/self", lambda: platform.collectives.send(tensor(2), rank, group))
    expect("recv/out_of_range", lambda: platform.collectives.recv(tensor(2), cp, group))
    gathered = platform.collectives.all_gather(platform.from_numpy(np.array([float(rank)])), group)
    outcomes["in_step"] = platform.to_numpy(gathered).ravel().tolist()
    return outcomes


def section_bad_input(platform: Platform, world: int) -> dict[str, Any]:
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    mesh = init_device_mesh("mindspore", (world,), mesh_dim_names=("cp",))
    return bad_input_checks(platform, mesh, lambda hk, h: GatedDeltaNet(HIDDEN, hk, h, 16, 8))


class _Solo:
    """The one-rank "mesh" that verify.compare_with_reference needs for a single-device run."""

    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def section_mesh2d(platform: Platform, world: int) -> dict[str, Any]:
    """CP along the cp axis of a (dp=2, cp=world/2) mesh, checked by verify.compare_with_reference
    against the float32 single-device layer and against the float64 truth (with the single-device
    float32 layer's own distance to the truth beside it)."""
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    mesh = init_device_mesh("mindspore", (2, world // 2), mesh_dim_names=("dp", "cp"))
    cp_mesh = mesh["cp"]
    case = Case(4, 4, 64, masked=True)
    layer_t = torch_layer(case)
    truth = GatedDeltaNet.from_torch(torch_layer(Case(4, 4, 64, masked=True, dtype="float64")))
    x, cot, mask = case_inputs(case)
    results: dict[str, Any] = {"cp_ranks": cp_mesh.rank_list, "dp_ranks": mesh.get_rank_list("dp")}
    results["single_vs_truth"] = compare_with_reference(
        platform,
        _Solo(),
        GatedDeltaNet.from_torch(layer_t),
        truth,
        x,
        cot,
        attention_mask=mask,
        reference_dtype="float64",
    )
    for mode in MODES:
        layer = LinearAttentionContextParallel(mode=mode).apply(GatedDeltaNet.from_torch(layer_t), cp_mesh)
        results[mode] = {
            "vs_single": compare_with_reference(
                platform, cp_mesh, layer, GatedDeltaNet.from_torch(layer_t), x, cot, attention_mask=mask
            ),
            "vs_truth": compare_with_reference(
                platform, cp_mesh, layer, truth, x, cot, attention_mask=mask, reference_dtype="float64"
            ),
        }
    return results


def section_grads(platform: Platform, world: int) -> dict[str, Any]:
    """Each rank's gradients are (rank + 1) times a fixed pattern (float32 and float64); summed
    over the cp axis and averaged over the dp axis of a (dp=2, cp=world/2) mesh, and over the 1-D
    cp mesh alone."""
    import mindspore as ms

    from hyperpar_gdn import sync_context_parallel_grads

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    scale = platform.rank() + 1
    grads = (
        ms.Tensor(scale * np.arange(6, dtype=np.float32).reshape(3, 2)),
        ms.Tensor(np.full((4,), 0.5 * scale, dtype=np.float64)),
    )
    both = sync_context_parallel_grads(grads, mesh, dp_axis="dp")
    cp_only = sync_context_parallel_grads(list(grads), mesh["cp"])
    return {
        "cp_group": mesh.get_rank_list("cp"),
        "both": [g.asnumpy().tolist() for g in both],
        "dtypes": [str(g.dtype) for g in both],
        "cp_only": [g.asnumpy().tolist() for g in cp_only],
        "inputs_unchanged": grads[0].asnumpy().tolist() == (scale * np.arange(6).reshape(3, 2)).tolist(),
    }


def section_stall(platform: Platform, world: int) -> dict[str, Any]:
    """The last rank stays alive but never joins an all-gather: the others must fail by themselves
    within the communication timeout, with a CollectiveError naming the collective."""
    comm, rank = platform.collectives, platform.rank()
    timeout = float(os.environ["MS_CPU_COMM_OP_TIMEOUT"])
    if rank == world - 1:
        time.sleep(timeout + 3)
        return {"stalled_s": timeout + 3}
    start = time.perf_counter()
    try:
        comm.all_gather(platform.from_numpy(np.ones(4)), None)
        outcome = ["no error", ""]
    except Exception as exc:
        outcome = [type(exc).__name__, str(exc)]
    return {"error": outcome, "waited_s": time.perf_counter() - start, "timeout_s": timeout}


def section_collectives(platform: Platform, world: int) -> dict[str, Any]:
    """Raw results of every collective on inputs the test can recompute from the ranks."""
    import mindspore as ms

    comm, rank = platform.collectives, platform.rank()
    out: dict[str, Any] = {}

    def grad_of(fn: Callable[[Any], Any], x: Any, cot: Any) -> tuple[Any, Any]:
        return ms.value_and_grad(fn, grad_position=0, sens_param=True)(x, cot)  # no bf16 sum on CPU

    def np_(x: Any) -> list[Any]:
        return platform.to_numpy(x).tolist()

    for dtype in ("float32", "float64", "bfloat16"):
        send = [(rank + 2 * j) % 3 for j in range(world)]  # rank r sends (r + 2j) % 3 rows to j
        recv = [(j + 2 * rank) % 3 for j in range(world)]
        rows = sum(send)
        # integers below 256: exact in bfloat16
        x = platform.from_numpy(16 * rank + np.arange(rows * 2).reshape(rows, 2), dtype=dtype)
        cot = platform.from_numpy(np.full((sum(recv), 2), rank + 1.0), dtype=dtype)
        comm.reset_bytes()
        value, dx = grad_of(lambda inp, s=send, r=recv: comm.all_to_all(inp, s, r, None), x, cot)
        out[f"all_to_all/{dtype}"] = {
            "send": send,
            "recv": recv,
            "out": np_(value),
            "dx": np_(dx),
            "dtype": str(value.dtype),
            "bytes": comm.reset_bytes(),
        }

        x = platform.from_numpy(np.full((2, 3), rank + 1.0), dtype=dtype)
        cot = platform.from_numpy(
            np.arange(world)[:, None, None] + np.zeros((world, 2, 3)) + 1.0, dtype=dtype
        )
        cot = cot * platform.from_numpy(np.array(rank + 1.0), dtype=dtype)
        value, dx = grad_of(lambda inp: comm.all_gather(inp, None), x, cot)
        out[f"all_gather/{dtype}"] = {"out": np_(value), "dx": np_(dx), "bytes": comm.reset_bytes()}

        x = platform.from_numpy(np.full((2,), rank + 1.0), dtype=dtype)
        cot = platform.from_numpy(np.full((2,), 10.0 * (rank + 1)), dtype=dtype)
        value, dx = grad_of(lambda inp: comm.shift_right(inp, None), x, cot)
        out[f"shift_right/{dtype}"] = {"out": np_(value), "dx": np_(dx), "bytes": comm.reset_bytes()}

    comm.reset_bytes()
    out["all_gather_int"] = {"values": comm.all_gather_int(10 * rank + 3, None), "bytes": comm.reset_bytes()}

    # zero rows everywhere, and an empty gather
    empty = platform.from_numpy(np.zeros((0, 3)))
    out["all_to_all/empty"] = list(comm.all_to_all(empty, [0] * world, [0] * world, None).shape)
    out["all_gather/empty"] = list(comm.all_gather(empty, None).shape)

    # raw send/recv along the chain, in float64
    comm.reset_bytes()
    if rank + 1 < world:
        comm.send(platform.from_numpy(np.arange(4) + 10.0 * rank, dtype="float64"), rank + 1, None)
    if rank > 0:
        got = comm.recv(platform.from_numpy(np.zeros(4), dtype="float64"), rank - 1, None)
        out["recv"] = {"values": np_(got), "dtype": str(got.dtype)}
    out["send_bytes"] = comm.reset_bytes()

    for dtype in ("float32", "float64"):
        x = platform.from_numpy(np.full((3,), rank + 1.0), dtype=dtype)
        total = comm.all_reduce_sum(x, None)
        out[f"all_reduce_sum/{dtype}"] = {
            "total": np_(total),
            "input_after": np_(x),
            "bytes": comm.reset_bytes(),
        }
    comm.barrier(None)

    if world >= 4:  # subgroups: the two halves, and a group this rank is not in
        halves = [
            platform.new_group(list(range(0, world // 2))),
            platform.new_group(list(range(world // 2, world))),
        ]
        mine, other = (halves[0], halves[1]) if rank < world // 2 else (halves[1], halves[0])
        gathered = comm.all_gather(platform.from_numpy(np.array([rank + 1.0])), mine)
        half = world // 2
        swapped = comm.all_to_all(
            platform.from_numpy(np.full((half, 1), float(rank))), [1] * half, [1] * half, mine
        )
        shifted = comm.shift_right(platform.from_numpy(np.array([rank + 1.0])), mine)
        total = comm.all_reduce_sum(platform.from_numpy(np.array([rank + 1.0])), mine)
        try:
            comm.all_gather(platform.from_numpy(np.array([1.0])), other)
            foreign = ["no error", ""]
        except Exception as exc:
            foreign = [type(exc).__name__, str(exc)]
        comm.barrier(mine)
        out["subgroup"] = {
            "ranks": list(mine.ranks),
            "same_handle": platform.new_group(list(mine.ranks)) is mine,
            "all_gather": platform.to_numpy(gathered).ravel().tolist(),
            "all_to_all": platform.to_numpy(swapped).ravel().tolist(),
            "shift_right": platform.to_numpy(shifted).ravel().tolist(),
            "all_reduce_sum": platform.to_numpy(total).ravel().tolist(),
            "foreign_group": foreign,
        }
    return out


PREFILL_T = 23  # 12 + 11 tokens at cp 2, 6 + 6 + 6 + 5 at cp 4
PREFILL_HEAD_TAIL_T = 24  # head_tail: 2cp pieces of 6 (cp 2) or 3 (cp 4) tokens, the conv halo
PREFILL_NEW_TOKENS = 16
PREFILL_MODES = (*MODES, "scan")


def prefill_model(moe: bool) -> Any:
    """A tiny MindSpore Qwen3.5 model, the same weights on every rank (numpy's seeded init)."""
    from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM, Qwen35Config

    sizes = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    config = Qwen35Config(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.3,  # peaked logits: no near ties in greedy decoding
        **({**sizes, "shared_expert_intermediate_size": 24} if moe else {"intermediate_size": 48}),
    )
    np.random.seed(0)
    return Qwen3_5ForCausalLM(config)


def continues_after_prefill(world: int, *, moe: bool, mode: str) -> bool:
    """Whether the prefill case of ``world`` ranks also decodes its greedy continuation."""
    return mode == "p2p" or (world == 2 and not moe)


def section_prefill(platform: Platform, world: int) -> dict[str, Any]:
    """Per model, mode and layout (``{dense,moe}/{mode}``, contiguous; ``dense/{mode}/head_tail``
    on a prompt of :data:`PREFILL_HEAD_TAIL_T`): the continuation (tokens) and the relative state
    errors against the single-device prefill of the same model."""
    import mindspore as ms

    from hyperpar_gdn.inference.decoding import greedy_continue, prefill

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(3)
    ids = ms.Tensor(rng.integers(1, 97, (2, PREFILL_T)).astype(np.int64))
    head_tail_ids = ms.Tensor(rng.integers(1, 97, (2, PREFILL_HEAD_TAIL_T)).astype(np.int64))
    results: dict[str, Any] = {}
    for moe in (False, True):
        model = prefill_model(moe)
        logits, state = prefill(model, ids)
        expected = greedy_continue(model, logits, state, max_new_tokens=PREFILL_NEW_TOKENS)
        for mode in PREFILL_MODES:
            # one mode continues for MoE, and at cp > 2 for both (MindSpore's decoding steps are
            # slow); every mode's states are compared
            continues = continues_after_prefill(world, moe=moe, mode=mode)
            entry = _prefill_case(
                platform,
                model,
                mesh,
                ids,
                (logits, state),
                mode=mode,
                layout="contiguous",
                continues=continues,
            )
            entry["expected"] = platform.to_numpy(expected).tolist()
            results[f"{'moe' if moe else 'dense'}/{mode}"] = entry
    model = prefill_model(False)
    reference = prefill(model, head_tail_ids)
    for mode in PREFILL_MODES:  # the states (equal states continue alike, as checked above)
        results[f"dense/{mode}/head_tail"] = _prefill_case(
            platform, model, mesh, head_tail_ids, reference, mode=mode, layout="head_tail", continues=False
        )
    return results


def _prefill_case(
    platform: Platform,
    model: Any,
    mesh: Any,
    ids: Any,
    reference: tuple[Any, Any],
    *,
    mode: str,
    layout: str,
    continues: bool,
) -> dict[str, Any]:
    """One CP prefill of ``ids`` ``[B, T]``: its relative errors against ``reference`` (the
    single-device logits and state), its length, and (``continues``) its greedy continuation."""
    from hyperpar_gdn import apply_context_parallel, prefill_context_parallel, undo_context_parallel
    from hyperpar_gdn.inference.decoding import greedy_continue

    logits, state = reference
    apply_context_parallel(model, mesh, mode=mode, layout=layout)
    cp_logits, cp_state = prefill_context_parallel(model, mesh, ids)
    undo_context_parallel(model)
    got = (
        greedy_continue(model, cp_logits, cp_state, max_new_tokens=PREFILL_NEW_TOKENS) if continues else None
    )
    errors = {"logits": relative_error(platform.to_numpy(cp_logits), platform.to_numpy(logits))}
    for i, (pair, ref_pair) in enumerate(zip(cp_state.layers, state.layers, strict=True)):
        for j, (a, b) in enumerate(zip(pair, ref_pair, strict=True)):
            errors[f"layer{i}.{j}"] = relative_error(platform.to_numpy(a), platform.to_numpy(b))
    return {
        "tokens": None if got is None else platform.to_numpy(got).tolist(),
        "length": cp_state.length,
        "errors": errors,
    }


CP_DECODING_NEW_TOKENS = 33  # 32 steps on the group


def section_cp_decoding(platform: Platform, world: int) -> dict[str, Any]:
    """Decoding on the CP group (dense model, p2p prefill): the new tokens and the single-device
    continuation, the K/V tokens this rank keeps, and the messages of the refused calls."""
    import mindspore as ms

    from hyperpar_gdn import apply_context_parallel, prefill_context_parallel, undo_context_parallel
    from hyperpar_gdn.inference.cp_decoding import greedy_continue_context_parallel, shard_cache
    from hyperpar_gdn.inference.decoding import greedy_continue, prefill

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = ms.Tensor(np.random.default_rng(5).integers(1, 97, (2, PREFILL_T)).astype(np.int64))
    model = prefill_model(moe=False)
    logits, state = prefill(model, ids)
    expected = greedy_continue(model, logits, state, max_new_tokens=CP_DECODING_NEW_TOKENS)
    apply_context_parallel(model, mesh, mode="p2p")
    cp_logits, cp_state = prefill_context_parallel(model, mesh, ids)
    refused = {}
    for name, target in (("under_cp", model), ("no_cache", model.model.layers[0].linear_attn)):
        try:
            shard_cache(target, mesh, cp_state, length=PREFILL_T)
            refused[name] = None
        except (ValueError, NotImplementedError) as err:
            refused[name] = f"{type(err).__name__}: {err}"
    undo_context_parallel(model)
    sharded = shard_cache(model, mesh, cp_state, length=PREFILL_T)
    kept_at_start = sharded.kv_bytes()
    got = greedy_continue_context_parallel(
        model, mesh, cp_logits, sharded, max_new_tokens=CP_DECODING_NEW_TOKENS
    )
    return {
        "tokens": platform.to_numpy(got).tolist(),
        "expected": platform.to_numpy(expected).tolist(),
        "kept": sorted({int(k.shape[2]) for k in (*sharded.keys.values(), *sharded.values.values())}),
        "length": sharded.length,
        "kv_bytes": [kept_at_start, sharded.kv_bytes()],
        "refused": refused,
    }


# The LM loss case: B, T, C, V and a chunk that divides neither T/2 = 7 nor T/4.
LM_LOSS_SHAPE = (2, 14, 8, 37)
LM_LOSS_CHUNK = 5


def lm_loss_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hidden ``[B, T, C]``, head ``[V, C]`` (float64) and shifted labels ``[B, T]`` with an
    ignored token and right padding."""
    b, t, c, v = LM_LOSS_SHAPE
    rng = np.random.default_rng(4)
    labels = rng.integers(0, v, (b, t))
    labels[0, 3] = -100
    labels[1, 9:] = -100
    return rng.standard_normal((b, t, c)), rng.standard_normal((v, c)), labels


def section_lm_loss(platform: Platform, world: int) -> dict[str, Any]:
    import mindspore as ms

    from hyperpar_gdn import context_parallel_lm_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    hidden, head, labels = lm_loss_inputs()
    local = hidden.shape[1] // world
    window = slice(platform.rank() * local, (platform.rank() + 1) * local)
    shard_labels = platform.from_numpy(labels[:, window], dtype="int64")

    def loss_fn(h: Any, w: Any) -> Any:
        return context_parallel_lm_loss(h, w, shard_labels, mesh, chunk_tokens=LM_LOSS_CHUNK)

    loss, (dh, dw) = ms.value_and_grad(loss_fn, (0, 1))(
        platform.from_numpy(hidden[:, window], dtype="float64"), platform.from_numpy(head, dtype="float64")
    )
    return {
        "loss": float(platform.to_numpy(loss)),
        "dtype": str(loss.dtype),
        "grad_hidden": platform.to_numpy(dh).tolist(),
        "grad_head": platform.to_numpy(dw).tolist(),
    }


# mode="scan" at cp 4: uneven contiguous shards and head_tail, packed documents crossing them.
SCAN_SHARDS = (20, 30, 16, 30)


def section_scan(platform: Platform, world: int) -> dict[str, Any]:
    """``mode="scan"`` (float64) against the torch layer run on each document alone, with uneven
    contiguous shards and in the head_tail layout; and the shapes this rank sent, forward and
    backward (the test counts the rounds)."""
    from hyperpar_gdn.distributed.layout import TokenLayout
    from hyperpar_gdn.models.mindspore import GatedDeltaNet

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    layer_t = torch_layer(Case(2, 4, PACKED_T, dtype="float64"))
    rng = np.random.default_rng(4)
    x, cot = rng.standard_normal((1, PACKED_T, HIDDEN)), rng.standard_normal((1, PACKED_T, HIDDEN))
    comm, results = platform.collectives, {}
    cases = {
        "uneven": ("contiguous", SCAN_SHARDS, PACKED_CASES["tiny-and-long"]),
        "head_tail": ("head_tail", [PACKED_T // world] * world, HEAD_TAIL_CU),
    }
    for name, (layout, lengths, cu) in cases.items():
        local = TokenLayout.of(layout, lengths).positions(mesh.get_local_rank())
        pieces = [
            torch_reference(layer_t, x[:, a:b], cot[:, a:b], None, "float64")
            for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
        reference = (
            np.concatenate([p[0] for p in pieces], 1),
            np.concatenate([p[1] for p in pieces], 1),
            {k: sum(p[2][k] for p in pieces) for k in PARAMS},
        )
        style = LinearAttentionContextParallel(mode="scan", chunk_size=8, layout=layout)
        layer = style.apply(GatedDeltaNet.from_torch(layer_t), mesh)
        sent: list[list[int]] = []
        exchange = comm.exchange

        def recorded(sends, recvs, group, sent=sent, exchange=exchange):
            sent.extend(list(t.shape) for t, _ in sends)
            return exchange(sends, recvs, group)

        comm.exchange = recorded
        try:
            out, (dx,), grads = platform.value_and_grads(
                lambda inp, layer=layer, cu_t=cu: layer(inp, cu_seqlens=np.asarray(cu_t)),
                [platform.from_numpy(x[:, local], dtype="float64")],
                platform.from_numpy(cot[:, local], dtype="float64"),
                layer,
            )
        finally:
            del comm.exchange  # the class's exchange again
        totals = {k: platform.to_numpy(comm.all_reduce_sum(g, mesh.get_group())) for k, g in grads.items()}
        results[name] = {
            "errors": _errors((platform.to_numpy(out), platform.to_numpy(dx), totals), reference, local),
            "sends": sent,
        }
    return results


def section_cpu_share(platform: Platform, world: int) -> dict[str, Any]:
    """The share the platform set (threads, cores) and every thread's name and allowed cores."""
    share = platform.cpu_share
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            threads[tid] = {"name": f.read().strip(), "cpus": sorted(os.sched_getaffinity(int(tid)))}
    return {
        "share": None if share is None else {"threads": share.threads, "cpus": share.cpus},
        "threads": list(threads.values()),
    }


SECTION_FUNCTIONS: dict[str, Callable[[Platform, int], dict[str, Any]]] = {
    "collectives": section_collectives,
    "cp": section_cp,
    "packed": section_packed,
    "attention": section_attention,
    "bad_input": section_bad_input,
    "mesh2d": section_mesh2d,
    "lm_loss": section_lm_loss,
    "grads": section_grads,
    "prefill": section_prefill,
    "stall": section_stall,
    "scan": section_scan,
    "cp_decoding": section_cp_decoding,
    "cpu_share": section_cpu_share,
    "two_level_head_tail": section_two_level_head_tail,
    "tp_layers": section_tp_layers,
    "tp_model": section_tp_model,
    "tp_bad_input": section_tp_bad_input,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--comm-timeout", type=float, default=20.0, help="seconds a collective may wait")
    args = parser.parse_args()
    start_watchdog()
    import torch

    torch.set_num_threads(1)
    platform = get_platform()
    platform.init_distributed(timeout_s=args.comm_timeout)  # msrun's scheduler process stays in here
    rank, world = platform.rank(), platform.world_size()
    result: dict[str, Any] = {"rank": rank, "world": world, "sections": {}}
    failed = False
    for name in args.sections:
        start = time.perf_counter()
        try:
            entry = {"ok": True, "data": SECTION_FUNCTIONS[name](platform, world)}
        except Exception:
            entry = {"ok": False, "error": traceback.format_exc()}
            failed = True
        entry["seconds"] = time.perf_counter() - start
        result["sections"][name] = entry
        write_result(rank, result)
        if failed:  # the other ranks may now wait in a collective: exit non-zero, msrun stops them
            return 1
    platform.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
