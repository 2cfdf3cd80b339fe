"""Expert parallelism for transformers' Qwen3.5 MoE blocks (torch): the routed experts split by
expert over a 1-D EP group, tokens dispatched to their experts' ranks by all-to-all.

``ExpertParallel().apply(block, mesh["ep"])`` keeps the block's own forward: its router
(``block.gate``: logits, softmax, top-k, the weights renormalised, as transformers computes them),
its shared expert and the shared expert's sigmoid gate run on this rank's tokens as the model
holds them. Only the routed experts change: ``experts.gate_up_proj [E, 2I, C]`` and
``experts.down_proj [E, C, I]`` become ``DTensor`` ``Shard(0)`` parameters on the EP mesh (rank r
holds experts ``[r E/ep, (r+1) E/ep)``: a checkpoint of them reshards to another ep), and the
experts' forward dispatches every (token, expert) pair to its expert's rank and combines the
outputs back (:func:`~.dispatch.expert_parallel_experts`). Every EP rank brings its own tokens (a
data-parallel or context-parallel shard): the experts' gradients are then whole over the EP
group's tokens; every other parameter's gradient is the rank's share, as without EP.

:func:`apply_expert_parallel` does the same for every MoE block of a whole model, checking every
block before changing any.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hyperpar_gdn.distributed.decoder_layers import find_decoder, is_silu
from hyperpar_gdn.distributed.mesh import DeviceMesh, as_cp_mesh
from hyperpar_gdn.expert_parallel.dispatch import expert_parallel_experts
from hyperpar_gdn.expert_parallel.grouped import grouped_swiglu

__all__ = [
    "EP_RECORD",
    "EXPERT_PARAMS",
    "ExpertParallel",
    "apply_expert_parallel",
    "expert_parallel_error",
    "expert_parallel_errors",
    "is_moe_block",
]

EP_RECORD = "_hyperpar_ep"  # on every expert-parallel MoE block: (num_experts, ep)
EXPERT_PARAMS = ("down_proj", "gate_up_proj")  # the routed experts' parameters


def is_moe_block(mlp: Any) -> bool:
    """Whether ``mlp`` is a Qwen3.5 sparse MoE block (router, experts, shared expert and gate)."""
    return all(hasattr(mlp, n) for n in ("gate", "experts", "shared_expert", "shared_expert_gate"))


def expert_parallel_error(block: nn.Module, ep: int) -> str | None:
    """Why ``block`` cannot be split over ``ep`` ranks by expert, or None."""
    if getattr(block, EP_RECORD, None) is not None:
        return "expert parallelism is already applied"
    if not is_moe_block(block):
        return f"{type(block).__name__} is not a Qwen3.5 sparse MoE block (gate, experts, shared_expert)"
    experts = block.experts
    names = {n for n, _ in experts.named_parameters()}
    if names != set(EXPERT_PARAMS) or hasattr(experts, "parametrizations"):
        return (
            f"experts ({type(experts).__name__}, parameters {sorted(names)}) is not transformers' fused "
            "experts: expert parallelism splits gate_up_proj and down_proj themselves and would bypass "
            "a wrapper (LoRA, quantization) around them"
        )
    if any(isinstance(p, DTensor) for p in experts.parameters()):
        return (
            "the experts are already split (tensor parallelism?): apply expert parallelism to whole experts"
        )
    act = getattr(experts, "act_fn", None)
    if not is_silu(act):
        return f"experts: activation {type(act).__name__} is not the SiLU of the SwiGLU experts"
    num_experts = experts.gate_up_proj.shape[0]
    if num_experts % ep:
        return f"num_experts={num_experts} is not divisible by ep={ep}"
    return None


def _meshes(mesh: Any) -> tuple[DeviceMesh, Any]:
    """(our 1-D mesh, the torch ``DeviceMesh`` on the same group) of an EP axis."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    ours = as_cp_mesh(mesh)
    if ours.platform.name == "mindspore":
        raise NotImplementedError(
            "expert parallelism runs on torch: MindSpore's MoE cell runs every expert on every token, "
            "with no token dispatch to split"
        )
    if isinstance(mesh, TorchDeviceMesh):
        return ours, mesh
    torch_mesh = TorchDeviceMesh.from_group(
        ours.get_group(), ours.device_type, mesh=list(ours.rank_list), mesh_dim_names=ours.mesh_dim_names
    )
    return ours, torch_mesh


def _shard_experts(experts: nn.Module, name: str, mesh: Any) -> None:
    """Parameter ``name`` ``[E, ...]`` as a DTensor ``Shard(0)``: this rank's E/ep experts, cut
    from the whole tensor every rank holds (no communication)."""
    p = experts._parameters[name]
    n = p.shape[0] // mesh.size()
    piece = p.detach().narrow(0, mesh.get_local_rank() * n, n).clone()
    dt = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False)
    experts._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)


class ExpertParallel(ParallelStyle):
    """A Qwen3.5 sparse MoE block's routed experts split by expert over a 1-D EP mesh (ours or
    torch's); router, shared expert and its gate local. ``experts_fn``: the experts' computation
    on rows grouped by expert (:func:`~.grouped.grouped_swiglu`: torch's grouped matmul where it
    runs, a loop otherwise; :func:`~.grouped.grouped_swiglu_loop` the reference)."""

    def __init__(self, *, experts_fn: Any = grouped_swiglu) -> None:
        super().__init__()
        self.experts_fn = experts_fn

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        return self._apply(module, mesh)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        ours, torch_mesh = _meshes(device_mesh)
        error = expert_parallel_error(module, ours.size())
        if error is not None:
            raise ValueError(f"expert parallelism at ep={ours.size()}: {error}")
        experts = module.experts
        num_experts = experts.gate_up_proj.shape[0]
        for name in sorted(EXPERT_PARAMS):
            _shard_experts(experts, name, torch_mesh)
        group, collectives, experts_fn = ours.get_group(), ours.platform.collectives, self.experts_fn

        def forward(
            hidden_NC: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            return expert_parallel_experts(
                hidden_NC,
                top_k_index,
                top_k_weights,
                gate_up_EIC=experts.gate_up_proj.to_local(),
                down_ECI=experts.down_proj.to_local(),
                num_experts=num_experts,
                group=group,
                collectives=collectives,
                experts_fn=experts_fn,
            )

        experts.forward = forward
        setattr(module, EP_RECORD, (num_experts, ours.size()))
        return module


def apply_expert_parallel(model: Any, mesh: Any, *, experts_fn: Any = grouped_swiglu) -> Any:
    """Split the routed experts of every MoE block of ``model`` (transformers' Qwen3.5 MoE causal
    LM, text model or multimodal model) over the 1-D EP ``mesh`` (e.g. ``mesh["ep"]``).

    Every block is checked before any changes: a wrong set-up is one ``ValueError`` on every rank,
    before any communication, naming each layer, the value and the rule. Returns ``model``,
    changed in place."""
    ours, _ = _meshes(mesh)
    errors = expert_parallel_errors(model, ours.size())
    if errors:
        raise ValueError(f"expert parallelism at ep={ours.size()}: " + "; ".join(errors))
    style = ExpertParallel(experts_fn=experts_fn)
    for _, mlp in _moe_blocks(model):
        style.apply(mlp, mesh)
    return model


def expert_parallel_errors(model: Any, ep: int) -> list[str]:
    """Why :func:`apply_expert_parallel` cannot split ``model``'s MoE blocks over ``ep`` ranks,
    one line per layer (empty: it can); no communication, no change."""
    blocks = _moe_blocks(model)
    errors = [f"layer {i}: {e}" for i, mlp in blocks if (e := expert_parallel_error(mlp, ep)) is not None]
    return errors if blocks else [*errors, "the model has no MoE block"]


def _moe_blocks(model: Any) -> list[tuple[int, nn.Module]]:
    _, text_model = find_decoder(model)
    return [(i, b.mlp) for i, b in enumerate(text_model.layers) if is_moe_block(getattr(b, "mlp", None))]
