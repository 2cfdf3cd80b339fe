"""Every context-parallel mode with ``kernel="fla"`` (fla's Triton kernels under Triton's interpreter,
real gloo ranks) equals the one-device fla kernel, our kernel and transformers' layer: a tiny
Qwen3.5 GDN layer (K = V = 32, 2 key heads and 4 value heads: grouped value heads), fp32, local
shards that are not chunk multiples; the output shard, the input gradient and every parameter
gradient (summed over the ranks), 1e-5 relative to the reference's largest entry. Packed documents
crossing shard boundaries and the head_tail layout's two fragments as well. Each forward is counted:
fla calls per layer forward by kind (the state modes: one widened call), and fla backward passes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction
from tiny_models import move_off_init

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.ops.gdn.kernels import FLA_CALLS
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, gdn_layer_forward
from hyperpar_gdn.ops.gdn.varlen import doc_starts_from_cu_seqlens
from hyperpar_gdn.platform import ops_for

TOL = 1e-5
STATE_MODES = ("p2p", "all_gather", "scan")
# (world, T, mode, inner_size, layout, cu_seqlens): shards of T/world tokens (20 or 12: not chunk
# multiples); documents cross the shard boundaries (20 at cp 2; 12, 24, 36 at cp 4)
CASES = {
    2: (
        40,
        [
            ("ulysses", None, "contiguous", None),
            ("ulysses_hidden", None, "contiguous", None),
            ("p2p", None, "contiguous", None),
            ("all_gather", None, "contiguous", None),
            ("scan", None, "contiguous", None),
            ("p2p", None, "contiguous", (0, 7, 26, 40)),
            ("ulysses", None, "contiguous", (0, 7, 26, 40)),
            ("all_gather", None, "head_tail", None),
            ("scan", None, "head_tail", (0, 3, 17, 40)),
        ],
    ),
    4: (
        48,
        [
            ("ulysses", None, "contiguous", None),
            ("p2p", None, "contiguous", None),
            ("all_gather", None, "contiguous", None),
            ("scan", None, "contiguous", (0, 5, 30, 48)),
            ("ulysses+p2p", 2, "contiguous", None),
            ("ulysses+all_gather", 2, "contiguous", (0, 5, 30, 48)),
            ("ulysses+scan", 2, "contiguous", None),
        ],
    ),
}


def _layers() -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    move_off_init(hf, 0.1, dt_bias_shift=-4.0)
    ours = GatedDeltaNet(32, 2, 4, 32, 32)
    ours.load_state_dict(hf.state_dict())
    return ours, hf


def _grads(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cot: torch.Tensor) -> dict:
    (y * cot).sum().backward()
    return {"output": y.detach(), "dx": x.grad} | {n: p.grad.clone() for n, p in module.named_parameters()}


def _one_device(ours: torch.nn.Module, hf: torch.nn.Module, x, cot, cu) -> dict[str, dict]:
    """fla's kernel and ours through our layer on one device; transformers' layer (which routes to
    fla's kernel itself here) when there is one document."""
    refs = {}
    starts = None if cu is None else doc_starts_from_cu_seqlens(cu, seq_len=x.shape[1])
    for kernel in ("fla", "native"):
        module = copy.deepcopy(ours)
        x_ref = x.clone().requires_grad_(True)
        y = gdn_layer_forward(
            ops_for(x), LayerWeights.of(module), LayerDims.of(module), x_ref, doc_starts=starts, kernel=kernel
        )
        refs[kernel] = _grads(module, x_ref, y, cot)
    if cu is None:
        module = copy.deepcopy(hf)
        x_ref = x.clone().requires_grad_(True)
        refs["transformers"] = _grads(module, x_ref, module(x_ref), cot)
    return refs


def _worker(rank: int, world: int, seq_len: int, cases: list, refs: list[dict]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ours, _ = _layers()
    gen = torch.Generator().manual_seed(5)
    x, cot = (torch.randn(1, seq_len, 32, generator=gen) for _ in range(2))
    backward_calls = [0]
    original = ChunkGatedDeltaRuleFunction.backward

    def counted(ctx, *grads):
        backward_calls[0] += 1
        return original(ctx, *grads)

    ChunkGatedDeltaRuleFunction.backward = staticmethod(counted)  # this forked rank only
    report: dict[str, Any] = {}
    for (mode, inner, layout, cu), ref in zip(cases, refs, strict=True):
        name = f"{mode}/{layout}/{'packed' if cu else 'one-doc'}"
        index = torch.as_tensor(TokenLayout.of(layout, [seq_len // world] * world).positions(rank))
        style = LinearAttentionContextParallel(mode, layout=layout, inner_size=inner, kernel="fla")
        layer = style.apply(copy.deepcopy(ours), mesh)
        assert style.kernel_choice.name == "fla", style.kernel_choice
        x_local = x[:, index].clone().requires_grad_(True)
        FLA_CALLS.clear()
        backward_calls[0] = 0
        out = layer(x_local, **({} if cu is None else {"cu_seqlens": torch.tensor(cu)}))
        forward_calls = dict(FLA_CALLS)
        (out * cot[:, index]).sum().backward()
        got = {"output": out.detach(), "dx": x_local.grad}
        for n, p in layer.named_parameters():
            got[n] = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
        errors = {}
        for ref_name, values in ref.items():
            worst = 0.0
            for key, value in got.items():
                expected = values[key][:, index] if key in ("output", "dx") else values[key]
                worst = max(worst, ((value - expected).abs().max() / values[key].abs().max()).item())
            errors[ref_name] = worst
        report[name] = {"errors": errors, "forward": forward_calls, "backward": backward_calls[0]}
    ChunkGatedDeltaRuleFunction.backward = staticmethod(original)
    return report


@pytest.mark.parametrize("world", sorted(CASES), ids=lambda w: f"cp{w}")
def test_every_mode_on_fla_equals_one_device(world: int) -> None:
    seq_len, cases = CASES[world]
    ours, hf = _layers()
    gen = torch.Generator().manual_seed(5)
    x, cot = (torch.randn(1, seq_len, 32, generator=gen) for _ in range(2))
    by_docs = {cu: _one_device(ours, hf, x, cot, cu) for cu in {case[3] for case in cases}}
    refs = [by_docs[case[3]] for case in cases]
    reports = run_ranks(_worker, world, seq_len, cases, refs, timeout_s=900)
    for rank, report in enumerate(reports):
        for (mode, inner, layout, _cu), (name, row) in zip(cases, report.items(), strict=True):
            print(f"cp{world} rank {rank} {name}: {row}")
            for ref_name, err in row["errors"].items():
                assert err <= TOL, f"cp{world} rank {rank} {name} against {ref_name}: {err:.2e} > {TOL:.0e}"
            state = mode.split("+")[-1] in STATE_MODES
            # one fla call per layer forward: the state modes' widened pass (the sequence's first
            # shard of a contiguous layout runs the plain call: no state enters it), else the plain call
            first = layout == "contiguous" and (rank if "+" not in mode else rank // inner) == 0
            expected = {"chunk": 1} if not state or first else {"widened": 1}
            assert row["forward"] == expected, (name, rank, row["forward"])
            assert row["backward"] == 1, (name, rank, row["backward"])
