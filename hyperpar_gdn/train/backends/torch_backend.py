"""The torch half of a training run (CPU/gloo, CUDA/NCCL, Ascend/HCCL through torch-npu).

The model is the built-in :class:`~hyperpar_gdn.models.lm.HybridLM` (seeded by the trainer) or a
transformers Qwen3.5 model read from ``--model DIR``; :func:`~hyperpar_gdn.parallel.compose.parallelize`
applies ``--ep``, ``--tp`` (over the TP axis of a torch ``(dp, cp, tp)`` mesh), context
parallelism (a transformers model gets our layers even without CP: its own would drop the packed
documents on a CPU), ``--ac`` and ``--fsdp``, in that order.

A step: the final hidden states and the head weight
(:func:`~hyperpar_gdn.integrations.transformers.lm_head.hidden_and_head`), the loss
:func:`~hyperpar_gdn.distributed.batch.context_parallel_lm_loss` (the ``[rows, T/cp, V]`` logits
are never held), backward, the gradient shares summed over the CP group and averaged over the DP
groups (by FSDP's reduce-scatter under ``--fsdp``), AdamW. ``--dtype bf16``: bf16 autocast (FSDP's
mixed-precision policy under ``--fsdp``); the head's matmuls in bf16, the rest of the loss in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import resource
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar_gdn.distributed.batch import ContextParallelBatch, context_parallel_lm_loss
from hyperpar_gdn.distributed.grads import sync_context_parallel_grads
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallelize import apply_context_parallel
from hyperpar_gdn.expert_parallel import load_balancing_loss, record_router_logits
from hyperpar_gdn.expert_parallel.grads import sync_expert_parallel_grads
from hyperpar_gdn.expert_parallel.style import is_moe_block
from hyperpar_gdn.integrations.transformers.lm_head import hidden_and_head
from hyperpar_gdn.integrations.transformers.model_dir import export_model_dir, load_model_dir
from hyperpar_gdn.models.lm import HybridLM
from hyperpar_gdn.platform import Platform
from hyperpar_gdn.tensor_parallel.comm import sync_tp_grads
from hyperpar_gdn.train.backends.base import TrainBackend, parallelize_run
from hyperpar_gdn.train.backends.optim import adamw_step, build_adamw, clip_gradients, torch_optimizer_step
from hyperpar_gdn.train.backends.state_dicts import (
    full_model_state_dict,
    full_state_dicts,
    load_full_state_dicts,
)
from hyperpar_gdn.train.checkpoints.directory import DCP_LAYOUT, read_manifest
from hyperpar_gdn.train.checkpoints.row_orders import model_row_orders, reorder_state
from hyperpar_gdn.train.config import TrainConfig

__all__ = ["TorchBackend"]


class TorchBackend(TrainBackend):
    """:class:`~hyperpar_gdn.train.backends.base.TrainBackend` on torch (see the module docstring)."""

    platforms = ("cpu", "cuda", "npu")
    checkpoint_formats = ("sharded", "whole")
    shard_layout = DCP_LAYOUT
    tensor_parallel = True
    expert_parallel = True

    @classmethod
    def check(cls, config: TrainConfig, platform_name: str) -> None:
        if platform_name not in cls.platforms:
            raise NotImplementedError(
                f"scripts/train.py trains on PyTorch only: HP_PLATFORM={' / '.join(cls.platforms)} "
                f"is supported, HP_PLATFORM={platform_name} is not (for mindspore use "
                "hyperpar_gdn.train.backends.mindspore_backend.MindSporeTrainer, which scripts/train.py picks)"
            )
        cls.check_tp_option(config, platform_name)
        cls.check_checkpoint_options(config, platform_name)

    def __init__(self, config: TrainConfig, platform: Platform, mesh: DeviceMesh, *, reference: bool) -> None:
        self.config, self.platform, self.mesh = config, platform, mesh
        self.device = platform.device
        self.cp_mesh = mesh["cp"]
        self.tokenizer = None
        if config.model_dir is not None:
            self.model, self.tokenizer = load_model_dir(config.model_dir)
            self.model.to(self.device).train()
        else:
            self.model = HybridLM(config.model).to(self.device)
        self.router_coef = _router_coefficient(config, self.model)  # before the parity copy
        self.reference = copy.deepcopy(self.model) if reference else None
        if self.reference is not None and self.tokenizer is not None:  # our layers, on one rank
            solo = DeviceMesh.from_group(platform, None, [platform.rank()], mesh_dim_name="cp")
            # one rank: every mode is the one-device layer (auto and two-level need the CP group)
            apply_context_parallel(self.reference, solo, mode="p2p")
        self.ref_optimizer = None if self.reference is None else build_adamw(self.reference, config)
        # --ep, --tp, CP, --ac, --fsdp in that order, every part checked on every rank first
        done = parallelize_run(
            self, config, self.model, mesh, cp=self.cp_mesh.size() > 1 or self.tokenizer is not None
        )
        self.ep_mesh = done.ep_mesh  # --ep: the (dp cp / ep, ep, tp) mesh over the same ranks
        self.torch_mesh = done.tp_mesh  # --tp: torch's (dp, cp, tp) mesh, which TP and FSDP share
        self._row_orders = model_row_orders(self.model)
        self.optimizer = build_adamw(self.model, config)  # over the sharded parameters under FSDP
        # --async-save: the background writes talk over a gloo group of their own, never the one
        # the training steps use at the same time
        self.save_group = torch.distributed.new_group(backend="gloo") if config.async_save else None

    # --- steps ------------------------------------------------------------------------------------
    def backward(self, shard: ContextParallelBatch, *, scale: float) -> tuple[float, float]:
        routers = record_router_logits(self.model) if self.router_coef else contextlib.nullcontext([])
        with self._autocast(), routers as router_logits:
            hidden, head = hidden_and_head(
                self.model,
                shard.input_ids.to(self.device),
                transformers=self.tokenizer is not None,
                cu_seqlens=self._on_device(shard.cu_seqlens),
            )
        if self.config.dtype == "bf16":  # the head's matmuls in bf16, the rest of the loss in fp32
            hidden = hidden.to(torch.bfloat16)
        loss = context_parallel_lm_loss(hidden, head, shard.labels.to(self.device), self.cp_mesh)
        objective = loss * scale
        if self.router_coef:
            # this rank's share of the global batch's load-balancing loss: times dp, as the DP
            # average divides it; over tp where the TP styles sum the router's gradient over the
            # TP ranks (each adds the same share; under --ep the block stays whole over tp)
            top_k = self.model.config.num_experts_per_tok
            share = load_balancing_loss(router_logits, top_k=top_k, meshes=(self.mesh["cp"], self.mesh["dp"]))
            self.aux_share = self.router_coef * float(share.detach())
            summed_over_tp = self.config.tp if self.ep_mesh is None else 1
            objective = objective + self.router_coef * share * (self.mesh["dp"].size() / summed_over_tp)
        objective.backward()
        if self.world_size > 1 and not self.config.fsdp:  # FSDP reduce-scatters them itself
            if self.ep_mesh is not None:
                sync_expert_parallel_grads(self.model, self.mesh, self.ep_mesh)
            elif self.torch_mesh is None:
                sync_context_parallel_grads(self.model, self.mesh, dp_axis="dp")
            else:  # TP shards' local gradients (each TP rank its own) beside whole ones
                sync_tp_grads(self.model, self.mesh)
        norm = clip_gradients(self.model, self.config.grad_clip)
        return float(loss.item()), norm

    def apply_step(self, *, lr: float) -> None:
        adamw_step(self.optimizer, lr=lr)

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reference_step(self, whole: ContextParallelBatch, *, lr: float) -> float:
        """Cross-entropy over the whole logits (an independent computation of the same loss), plus
        the router's load-balancing loss on the whole batch when it is on."""
        assert self.reference is not None and self.ref_optimizer is not None
        inputs = whole.input_ids.to(self.device)
        cu = self._on_device(whole.cu_seqlens)
        routers = record_router_logits(self.reference) if self.router_coef else contextlib.nullcontext([])
        with self._autocast(), routers as router_logits:
            if self.tokenizer is None:
                packed = {} if cu is None else {"cu_seqlens": cu}
                logits = self.reference(inputs, **packed)
            else:
                packed = {} if cu is None else {"cu_seq_lens_q": cu}
                logits = self.reference(input_ids=inputs, use_cache=False, **packed).logits
        labels = whole.labels.to(self.device)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if self.router_coef:  # transformers' load_balancing_loss_func on the whole batch
            top_k = self.reference.config.num_experts_per_tok
            loss = loss + self.router_coef * load_balancing_loss(router_logits, top_k=top_k)
        loss.backward()
        torch_optimizer_step(self.reference, self.ref_optimizer, grad_clip=self.config.grad_clip, lr=lr)
        return loss.item()

    def _on_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.device)

    def _autocast(self) -> Any:
        """bf16 autocast under ``--dtype bf16`` without FSDP (whose MixedPrecisionPolicy casts)."""
        if self.config.dtype != "bf16" or self.config.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # --- checkpoints and export ----------------------------------------------------------------------
    def row_orders(self) -> dict[str, Any]:
        return self._row_orders

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = full_state_dicts(self.model, self.optimizer)
        reorder_state(model, optimizer, self._row_orders, {})  # the single-device order
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, path: str, parts: dict[str, Any]) -> None:
        if "param_groups" not in parts["optimizer"]:
            raise ValueError(
                f"checkpoint {path} holds no torch AdamW state (optimizer format "
                f"{parts['optimizer'].get('format')!r}: written on MindSpore?); resume it with "
                "HP_PLATFORM=mindspore, or load only its model part"
            )
        model_state, optimizer_state = parts["model"], parts["optimizer"]
        if self._row_orders:  # the whole format's single-device order -> this --tp model's
            model_state = dict(model_state)
            states = {name: dict(moments) for name, moments in optimizer_state.get("state", {}).items()}
            optimizer_state = {**optimizer_state, "state": states}
            reorder_state(model_state, optimizer_state, {}, self._row_orders)
        load_full_state_dicts(self.model, self.optimizer, model_state, optimizer_state)
        if self.reference is not None and self.ref_optimizer is not None:
            # its own copy: an optimizer keeps the tensors it loads, and would share them with the model's
            optimizer_state = copy.deepcopy(parts["optimizer"])
            load_full_state_dicts(self.reference, self.ref_optimizer, parts["model"], optimizer_state)

    def save_shards(self, directory: Path, *, background: bool) -> Future | None:
        from hyperpar_gdn.train.checkpoints.sharded import STATE_DIR, sharded_state, write_shards
        from hyperpar_gdn.train.checkpoints.whole import nonfinite_entries
        from hyperpar_gdn.train.errors import CheckpointError

        state = sharded_state(self.model, self.optimizer)
        bad = nonfinite_entries(state)  # this rank's pieces: no collective
        if self.max_over_ranks(int(bool(bad))):
            names = ", ".join(bad[:3]) if bad else "another rank's tensors"
            raise CheckpointError(f"refusing to save into {directory}: {names} hold NaN or inf values")
        return write_shards(state, directory / STATE_DIR, group=self.save_group, background=background)

    def load_shards(self, path: str, shards: str, *, layout: str) -> None:
        from hyperpar_gdn.train.checkpoints.sharded import load_shards, load_whole

        if layout != DCP_LAYOUT:
            raise ValueError(
                f"checkpoint {path} holds the per-rank parts of a replicated state (layout {layout!r}, "
                "MindSpore's AdamW state, written under HP_PLATFORM=mindspore): resume it there, or "
                "convert it (python -m hyperpar_gdn.train.checkpoints.convert --to whole) and load only its model part"
            )
        saved = read_manifest(Path(shards).parent)["meta"].get("row_orders", {})
        load_shards(Path(shards), self.model, self.optimizer, saved_orders=saved, orders=self._row_orders)
        if self.reference is not None and self.ref_optimizer is not None:  # rank 0 alone, whole
            whole = load_whole(Path(shards))
            reorder_state(whole["model"], whole["optimizer"], saved, {})
            load_full_state_dicts(self.reference, self.ref_optimizer, whole["model"], whole["optimizer"])

    def exporter(self, out: str) -> Callable[[], None]:
        state = full_model_state_dict(self.model)  # every rank gathers its shards under FSDP and TP
        reorder_state(state, None, self._row_orders, {})  # the single-device order
        return lambda: export_model_dir(self.model, self.tokenizer, out, state_dict=state)

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def model_config(self) -> dict[str, Any]:
        return self.model.config.to_dict() if self.tokenizer is not None else self.config.model.to_dict()

    # --- ranks and the device ------------------------------------------------------------------------
    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        # float64 for loss sums and statistics, but float32 on NPUs (HCCL reduces fewer dtypes)
        dtype = torch.float32 if self.device.type == "npu" else torch.float64
        totals = torch.tensor(list(values), dtype=dtype, device=self.device)
        self.platform.collectives.all_reduce_sum(totals, None)
        return totals.tolist()

    def peak_memory(self) -> tuple[int, str]:
        return peak_memory(self.device)

    def silent_ranks(self, tag: str, *, wait_s: float) -> list[int] | None:
        """The roll call through the default group's c10d store (torchrun's agent hosts it, so it
        answers while a worker is stopped). torch has no public accessor for that store."""
        import time

        import torch.distributed as dist

        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"hyperpar_gdn/roll/{tag}/{self.rank}", "1")
            keys = {r: f"hyperpar_gdn/roll/{tag}/{r}" for r in range(self.world_size)}
            deadline = time.monotonic() + wait_s
            while True:
                silent = [r for r, key in keys.items() if not store.check([key])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.1)
        except Exception:  # the store itself is gone (its host was the stopped rank)
            return None

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "npu":
            torch.npu.synchronize(self.device)  # type: ignore[attr-defined]


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): the allocator's peak on an accelerator, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "allocated"
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device), "allocated"  # type: ignore[attr-defined]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def _router_coefficient(config: TrainConfig, model: torch.nn.Module) -> float:
    """The load-balancing loss's weight: ``--router-aux-loss-coef``, else the model's
    ``router_aux_loss_coef`` when its config sets ``output_router_logits``, else 0. The trainer
    computes that loss itself over the global batch: the model's own flag is turned off."""
    model_config = getattr(model, "config", None)
    wants = bool(getattr(model_config, "output_router_logits", False))
    coef = config.router_aux_loss_coef
    if coef is None:
        coef = float(getattr(model_config, "router_aux_loss_coef", 0.0)) if wants else 0.0
    if coef and not any(is_moe_block(m) for m in model.modules()):
        raise ValueError(
            f"--router-aux-loss-coef {coef}: {config.model_name} has no MoE block (no router to balance)"
        )
    if wants:
        model_config.output_router_logits = False
    return coef
