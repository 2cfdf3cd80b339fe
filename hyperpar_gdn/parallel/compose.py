"""``parallelize(model, mesh, config)``: every parallelism of a model, checked, then applied in order.

The order: expert parallelism (the MoE blocks' routed experts over ``ep`` ranks; those blocks then
stay whole over tp), tensor parallelism (blocks by heads and columns over the ``tp`` axis),
context parallelism (the mixers over the ``cp`` axis, on each TP rank's heads), activation
checkpointing (each decoder layer, as CP changed it, recomputed in the backward), FSDP2 (over
the ``dp x cp`` ranks of each TP rank, last: it shards what the others made).

Two phases. First every part's checks, on this rank alone (no communication, no change): the
options (:meth:`~hyperpar_gdn.parallel.config.ParallelConfig.errors`), the mesh, the experts,
the TP plan (knowing the experts will be split), the CP plan (``"auto"`` resolved here, in
:func:`~hyperpar_gdn.distributed.parallelize.resolve_plan`, on a TP rank's heads) and its
checks on a TP rank's layers, the wrappers of AC and FSDP; then the ranks agree (one all-gather
of an int over the world): a rank that refused, or was given another set-up, stops every rank
with the same line before anything changes. Then the meshes are built and the parts applied;
an exception there undoes context parallelism and activation checkpointing (expert and tensor
parallelism re-make the parameters as shards, which nothing undoes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.agreement import first, gather_verdicts, ranks_by_value
from hyperpar_gdn.distributed.decoder_layers import text_model_of
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallelize import (
    apply_context_parallel,
    context_parallel_errors,
    resolve_plan,
    undo_context_parallel,
)
from hyperpar_gdn.parallel.config import ParallelConfig
from hyperpar_gdn.planning.plan import CPPlan

__all__ = ["Parallelized", "parallelize"]

AXES = ("dp", "cp", "tp")  # the mesh's axes, outermost first; the ones a mesh leaves out have one rank
_TORCH_PARTS = ("tp", "ep", "fsdp")


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` made: the model (changed in place) and what its steps need.

    Attributes:
        model: the model given.
        cp_plan: the context-parallel plan (``"auto"``'s choice, its ``reason`` saying why), or None.
        tp_mesh: torch's ``(dp, cp, tp)`` mesh under tensor parallelism, else None.
        ep_mesh: the ``(ep_replica, ep, tp)`` mesh under expert parallelism
            (:func:`~hyperpar_gdn.expert_parallel.grads.expert_mesh`; torch's under FSDP), else None.
        fsdp_mesh: the 1-D torch mesh FSDP shards over, else None.
    """

    model: Any
    cp_plan: CPPlan | None
    tp_mesh: Any
    ep_mesh: Any
    fsdp_mesh: Any


def parallelize(model: Any, mesh: DeviceMesh, config: ParallelConfig) -> Parallelized:
    """Apply ``config``'s parallelisms to ``model`` over ``mesh``, in the order of the module
    docstring. Call it on every rank of the world with the same options and model.

    Args:
        model: ``HybridLM`` or transformers' Qwen3.5 causal LM / text model / multimodal model (a
            ``PeftModel`` around one for context parallelism alone).
        mesh: the world as a row-major :class:`~hyperpar_gdn.DeviceMesh` whose axes are named
            from ``("dp", "cp", "tp")``, in that order (one left out has one rank), e.g.
            ``init_device_mesh("cuda", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))``.
        config: the parallelisms (:class:`~hyperpar_gdn.parallel.config.ParallelConfig`).

    A set-up that cannot run is one error on every rank, naming the value and the rule, raised
    before any change (and before any communication but the ranks' one all-gather).
    """
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ParallelConfig; got {type(config).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be hyperpar_gdn's DeviceMesh (init_device_mesh(...)); got {type(mesh).__qualname__}"
        )
    plan, errors = _check(model, mesh, config)
    _agree(mesh, _fingerprint(model, mesh, config, plan), first(errors))
    return _apply(model, mesh, config, plan)


# --- phase 1: the checks -------------------------------------------------------------------------
def _sizes(mesh: DeviceMesh) -> dict[str, int]:
    names = mesh.mesh_dim_names or ()
    return {axis: mesh.size(axis) if axis in names else 1 for axis in AXES}


def _mesh_errors(mesh: DeviceMesh, config: ParallelConfig) -> list[Exception]:
    names = tuple(mesh.mesh_dim_names or ())
    if not names or "cp" not in names or names != tuple(a for a in AXES if a in names):
        return [
            ValueError(
                f"mesh has dim names {mesh.mesh_dim_names}: name its axes from ('dp', 'cp', 'tp'), in that "
                "order, with 'cp' among them"
            )
        ]
    sizes, found = _sizes(mesh), []
    world = mesh.platform.world_size()
    ranks = _flat(mesh.mesh)
    if ranks != list(range(world)):
        found.append(
            ValueError(
                f"mesh {mesh.shape} holds ranks {ranks}: it must be the {world} ranks of the world in order"
            )
        )
    if sizes["tp"] != config.tp:
        found.append(ValueError(f"tp={config.tp} but the mesh's tp axis has {sizes['tp']} ranks"))
    dp_cp = sizes["dp"] * sizes["cp"]
    if config.ep > 1 and dp_cp % config.ep:
        found.append(
            ValueError(
                f"ep={config.ep} must divide the data-parallel x CP ranks dp x cp = {sizes['dp']} x {sizes['cp']} "
                "(expert parallelism spans ranks that hold different tokens)"
            )
        )
    if mesh.platform.name == "mindspore":
        torch_only = [
            f"{n}={getattr(config, n)!r}" for n in _TORCH_PARTS if getattr(config, n) not in (1, False)
        ]
        if torch_only:
            found.append(
                NotImplementedError(
                    f"{', '.join(torch_only)}: torch's (HP_PLATFORM=cpu / cuda / npu); on MindSpore "
                    "parallelize applies context parallelism and activation checkpointing (tensor "
                    "parallelism: hyperpar_gdn.tensor_parallel.mindspore_apply)"
                )
            )
    if sizes["cp"] > 1 and config.cp_mode is None:
        found.append(
            ValueError(f"the mesh's cp axis has {sizes['cp']} ranks but cp_mode is None: name a mode")
        )
    return found


def _flat(nested: list[Any]) -> list[int]:
    return [r for item in nested for r in (_flat(item) if isinstance(item, list) else [item])]


def _check(model: Any, mesh: DeviceMesh, config: ParallelConfig) -> tuple[CPPlan | None, list[Exception]]:
    """(the CP plan, every error): each part's checks, as the model will be when its turn comes."""
    errors = config.errors() + _mesh_errors(mesh, config)
    if errors:  # the model's checks read sizes these make sure of
        return None, errors
    plan, sizes = None, _sizes(mesh)
    try:
        if config.ep > 1:
            from hyperpar_gdn.expert_parallel.style import expert_parallel_errors

            found = expert_parallel_errors(model, config.ep)
            if found:
                errors.append(ValueError(f"expert parallelism at ep={config.ep}: " + "; ".join(found)))
            elif config.fsdp:
                errors += _expert_fsdp_errors(
                    model, config.ep, replicas=sizes["dp"] * sizes["cp"] // config.ep
                )
        if config.tp > 1:
            from hyperpar_gdn.tensor_parallel.apply import tensor_parallel_plan

            try:
                tensor_parallel_plan(text_model_of(model), config.tp, moe_expert_parallel=config.ep > 1)
            except ValueError as error:
                errors.append(error)
        if config.cp_mode is not None:
            plan = _resolve(model, mesh, config)
            errors += context_parallel_errors(model, mesh["cp"], plan, tp=config.tp)
        errors += _wrapper_errors(model, mesh, config)
    except (ValueError, TypeError, NotImplementedError) as error:
        errors.append(error)
    return plan, errors


def _expert_fsdp_errors(model: Any, ep: int, *, replicas: int) -> list[Exception]:
    """FSDP over the experts' ``replicas``: each MoE block's experts, as one of ``ep`` ranks will
    hold them, must cut over the replicas along some dim."""
    from hyperpar_gdn.expert_parallel.fsdp import replica_cut, replica_cut_error
    from hyperpar_gdn.expert_parallel.style import EXPERT_PARAMS, is_moe_block

    for block in text_model_of(model).layers:
        mlp = getattr(block, "mlp", None)
        if is_moe_block(mlp):
            local = {
                n: (p.shape[0] // ep, *p.shape[1:])
                for n, p in mlp.experts.named_parameters()
                if n in EXPERT_PARAMS
            }
            if replica_cut(local, replicas) is None:
                return [ValueError(replica_cut_error(local, replicas))]
    return []


def _resolve(model: Any, mesh: DeviceMesh, config: ParallelConfig) -> CPPlan:
    plan = config.cp_plan()
    if plan is not None:
        return plan
    from hyperpar_gdn.platform.memory_budget import local_ranks

    return resolve_plan(
        model,
        mesh["cp"],
        mode="auto",
        layout=config.cp_layout,
        inner_size=config.cp_inner_size,
        chunk_size=config.cp_chunk_size,
        kernel=config.gdn_kernel,
        seq_len=config.seq_len,
        dtype="bfloat16" if config.bf16 else "float32",
        devices_per_node=local_ranks(0) or None,
        tp=config.tp,
    )


def _wrapper_errors(model: Any, mesh: DeviceMesh, config: ParallelConfig) -> list[Exception]:
    """Activation checkpointing or FSDP already on the model: applying them again is refused."""
    found: list[Exception] = []
    if config.activation_checkpointing and mesh.platform.name != "mindspore":
        from hyperpar_gdn.parallel.checkpointing import is_checkpointed

        if any(is_checkpointed(layer) for layer in text_model_of(model).layers):
            found.append(ValueError("activation checkpointing is already applied to the decoder layers"))
    if config.fsdp:
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            found.append(ValueError(f"{type(model).__name__} is already sharded by FSDP (fully_shard)"))
    return found


def _fingerprint(model: Any, mesh: DeviceMesh, config: ParallelConfig, plan: CPPlan | None) -> int:
    """One int of what the ranks must share: the options, the plan, the mesh and the parameters'
    names and shapes."""
    named = model.named_parameters() if hasattr(model, "named_parameters") else model.parameters_and_names()
    shapes = [(name, tuple(p.shape)) for name, p in named]  # torch, or a MindSpore cell
    chosen = None if plan is None else (plan.mode, plan.layout, plan.inner_size, plan.chunk_size, plan.kernel)
    what = repr((config, chosen, mesh.shape, mesh.mesh_dim_names, shapes))
    return int.from_bytes(hashlib.sha256(what.encode()).digest()[:7], "big")


def _agree(mesh: DeviceMesh, code: int, error: Exception | None) -> None:
    """Every rank stops with the same line unless none refused and all were given the same set-up:
    one all-gather of one int over the world."""
    codes = gather_verdicts(
        mesh.platform.collectives, None, None if error is not None else code, error, ranks="ranks"
    )
    if len(set(codes)) > 1:
        groups = "; ".join(f"ranks {ranks}" for ranks in ranks_by_value(codes).values())
        raise ValueError(
            f"the ranks were given different set-ups ({groups} agree among themselves): launch every rank "
            "with the same ParallelConfig, mesh and model"
        )


# --- phase 2: the parts, in order ------------------------------------------------------------------
def _apply(model: Any, mesh: DeviceMesh, config: ParallelConfig, plan: CPPlan | None) -> Parallelized:
    sizes, device_type = _sizes(mesh), mesh.device_type
    tp_mesh = ep_mesh = fsdp_mesh = None
    undo: list[Callable[[], None]] = []
    try:
        if config.ep > 1:
            from hyperpar_gdn.expert_parallel import apply_expert_parallel
            from hyperpar_gdn.expert_parallel.fsdp import expert_torch_mesh
            from hyperpar_gdn.expert_parallel.grads import expert_mesh

            build = expert_torch_mesh if config.fsdp else expert_mesh  # FSDP shards over torch's axes
            ep_mesh = build((sizes["dp"], sizes["cp"], config.tp), config.ep, device_type=device_type)
            apply_expert_parallel(model, ep_mesh["ep"])
        if config.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from hyperpar_gdn.tensor_parallel.apply import apply_tensor_parallel

            shape = tuple(sizes[a] for a in AXES)
            tp_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
            apply_tensor_parallel(model, tp_mesh["tp"])
        if plan is not None:
            apply_context_parallel(model, mesh["cp"], plan=plan)
            undo.append(lambda: undo_context_parallel(model))
        if config.activation_checkpointing:
            from hyperpar_gdn.parallel.checkpointing import (
                apply_activation_checkpointing,
                remove_activation_checkpointing,
            )

            framework = "mindspore" if mesh.platform.name == "mindspore" else "torch"
            apply_activation_checkpointing(model, framework=framework)
            if framework == "torch":
                undo.append(lambda: remove_activation_checkpointing(model))
        if config.fsdp:
            from hyperpar_gdn.parallel.fsdp import apply_fsdp, fsdp_mesh_of

            fsdp_mesh = fsdp_mesh_of(device_type, tp_mesh)
            replicas = None if ep_mesh is None else ep_mesh["ep_replica"]  # the experts' own axis
            apply_fsdp(
                model,
                device_type=device_type,
                dp=sizes["dp"],
                bf16=config.bf16,
                mesh=fsdp_mesh,
                expert_replicas=replicas,
            )
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return Parallelized(model=model, cp_plan=plan, tp_mesh=tp_mesh, ep_mesh=ep_mesh, fsdp_mesh=fsdp_mesh)
