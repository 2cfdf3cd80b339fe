"""The MindSpore half of a training run (PyNative, MCCL on CPU / HCCL on Ascend under ``msrun``).

:class:`MindSporeTrainer` is :class:`hyperpar_gdn.train.loop.trainer.Trainer` with :class:`MindSporeBackend`:
the same options (:class:`TrainConfig`), batches (:mod:`~hyperpar_gdn.train.data.global_batches` and :mod:`~hyperpar_gdn.train.data.rank_batches`,
so both platforms draw and cut the very same tokens), loss (``context_parallel_lm_loss``), logging, resume,
parity check, summary and metrics. What the backend does its own way:

- the model is :class:`hyperpar_gdn.models.mindspore.HybridLM`, made with
  :meth:`~hyperpar_gdn.models.mindspore.HybridLM.from_torch` from the torch model that
  ``torch.manual_seed(--seed)`` draws: both platforms start from the same weights; with
  ``--model DIR`` it is :class:`hyperpar_gdn.models.mindspore.Qwen3_5ForCausalLM` read from the
  directory (only the tokenizer comes from transformers), and ``--export`` writes it back;
- gradients come from ``mindspore.value_and_grad``; the loss term of each rank is its sum of token
  losses over the tokens of its DP replica, gradients are summed over the CP group and averaged
  over the DP groups: the gradient of the mean loss over the global batch, as on torch;
- ``--dtype bf16`` is refused (:data:`BF16_REFUSED` says why): MindSpore trains in fp32;
- the optimizer is :class:`~.mindspore_adamw.AdamW`: MindSpore's library AdamW (torch's
  ``AdamW`` maths) set up as torch's (decay on matrices, betas (0.9, 0.95), eps 1e-8), with
  torch's global-norm clipping;
- checkpoints have the same layout and parts; the ``model`` part is a torch state dict with the
  torch model's names (a torch ``HybridLM`` loads it; for ``--model``, transformers' names), the
  ``optimizer`` part is :class:`~.mindspore_adamw.AdamW`'s own state (format
  :data:`~.mindspore_adamw.ADAMW_FORMAT`), so a run resumes on the platform that saved it;
  sharded by default, as on torch, in the replicated layout (:mod:`~hyperpar_gdn.train.checkpoints.replicated_shards`: the state
  is the same on every rank, each rank writes a disjoint part, as a safetensors-layout file;
  ``--async-save``: a thread writes the part's host copies), or whole (format 1, rank 0).
"""

from __future__ import annotations

import functools
import resource
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
import torch

from hyperpar_gdn.distributed.batch import ContextParallelBatch, context_parallel_lm_loss
from hyperpar_gdn.distributed.grads import sync_context_parallel_grads
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.integrations.transformers.model_dir import export_model_dir, load_tokenizer
from hyperpar_gdn.models.lm import HybridLM as TorchHybridLM
from hyperpar_gdn.models.mindspore import HybridLM, Qwen3_5ForCausalLM, load_torch_state_dict
from hyperpar_gdn.models.mindspore.weights import DTYPES
from hyperpar_gdn.platform import Platform
from hyperpar_gdn.train.backends.base import TrainBackend, parallelize_run
from hyperpar_gdn.train.backends.mindspore_adamw import ADAMW_FORMAT, AdamW, clip_grad_norm
from hyperpar_gdn.train.checkpoints.directory import REPLICATED_LAYOUT
from hyperpar_gdn.train.checkpoints.replicated_shards import Leaf, write_replicated_shards
from hyperpar_gdn.train.checkpoints.sharded import STATE_DIR, load_whole_state
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.loop.trainer import Trainer

__all__ = ["MindSporeBackend", "MindSporeTrainer"]

BF16_REFUSED = (
    "--dtype {dtype} trains on torch only: MindSpore 2.10 has no bf16 kernels on CPU for MatMul, "
    "BatchMatMul, Exp, Softmax, Sigmoid, Rsqrt or reductions (measured), and its "
    "auto_mixed_precision does not reach these models' functional maths (amp_level 'auto' leaves "
    "them fp32, 'O1' and 'O2' fail); use --dtype fp32 on MindSpore"
)


# numpy's name of each MindSpore dtype a checkpoint holds (numpy has no bfloat16; nor does training)
_NUMPY_NAMES = {ms_dtype: name for name, ms_dtype in DTYPES.items() if name != "bfloat16"}


def _leaf(tensor: ms.Tensor) -> Leaf:
    """``tensor`` as a :class:`~hyperpar_gdn.train.checkpoints.replicated_shards.Leaf`: read, it is copied to a host array."""
    dtype = _NUMPY_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(
            f"a {tensor.dtype} tensor cannot be saved sharded: the parts hold {', '.join(_NUMPY_NAMES.values())}"
        )
    return Leaf(tuple(tensor.shape), dtype, lambda: np.array(tensor.asnumpy(), copy=True))


class _Replica:
    """A model, its optimizer and its loss-and-gradient function over the CP mesh ``cp_mesh``."""

    def __init__(
        self, model: HybridLM | Qwen3_5ForCausalLM, config: TrainConfig, cp_mesh: DeviceMesh
    ) -> None:
        self.model = model
        named = [(name, p) for name, p in model.parameters_and_names() if p.requires_grad]
        self.params = [p for _, p in named]
        self.grad_clip = config.grad_clip
        self.optimizer = AdamW(self.params, weight_decay=config.weight_decay, names=[n for n, _ in named])

        def loss_fn(
            inputs: ms.Tensor, labels: ms.Tensor, scale: ms.Tensor, cu_seqlens: ms.Tensor | None
        ) -> tuple[ms.Tensor, ms.Tensor]:
            # the chunked LM loss: the [rows, T_local, V] logits are never held
            hidden = model.final_hidden_states(inputs, cu_seqlens)
            loss = context_parallel_lm_loss(hidden, model.head_weight, labels, cp_mesh)
            return loss * scale, loss

        self.value_and_grad = ms.value_and_grad(loss_fn, None, self.params, has_aux=True)

    def loss_and_grads(self, shard: ContextParallelBatch, scale: float) -> tuple[float, list[ms.Tensor]]:
        """(the context-parallel LM loss, gradients of it times ``scale``) on the host ``shard``."""
        cu = None if shard.cu_seqlens is None else ms.Tensor(shard.cu_seqlens.numpy())
        (_, loss), grads = self.value_and_grad(
            ms.Tensor(shard.input_ids.numpy()),
            ms.Tensor(shard.labels.numpy()),
            ms.Tensor(scale, ms.float32),
            cu,
        )
        return float(loss.asnumpy()), list(grads)

    def step(self, grads: Sequence[ms.Tensor], lr: float) -> None:
        """Clip the global norm (``--grad-clip`` > 0), then AdamW at ``lr``."""
        if self.grad_clip > 0:
            grads, _ = clip_grad_norm(grads, self.grad_clip)
        self.optimizer.step(grads, lr)


class MindSporeBackend(TrainBackend):
    """:class:`~hyperpar_gdn.train.backends.base.TrainBackend` on MindSpore (see the module docstring)."""

    platforms = ("mindspore",)
    checkpoint_formats = ("sharded", "whole")  # sharded by default, as on torch
    shard_layout = REPLICATED_LAYOUT

    @classmethod
    def check(cls, config: TrainConfig, platform_name: str) -> None:
        if platform_name not in cls.platforms:
            raise NotImplementedError(
                f"MindSporeTrainer needs HP_PLATFORM=mindspore (got {platform_name}); use Trainer for torch"
            )
        if config.dtype != "fp32":
            raise NotImplementedError(BF16_REFUSED.format(dtype=config.dtype))
        if config.fsdp:
            raise NotImplementedError(
                "--fsdp is torch's FSDP2; on MindSpore parameters stay replicated (use --ac to save memory)"
            )
        cls.check_tp_option(config, platform_name)
        cls.check_checkpoint_options(config, platform_name)

    def __init__(self, config: TrainConfig, platform: Platform, mesh: DeviceMesh, *, reference: bool) -> None:
        """The model from the torch model that the trainer's seed draws (or from ``--model DIR``),
        context parallel over ``mesh["cp"]``, its replica with the optimizer, and the rank-0 copy
        for ``--check-parity``."""
        self.config, self.platform, self.mesh = config, platform, mesh
        self.tokenizer = None
        if config.model_dir is not None:
            self.tokenizer = load_tokenizer(config.model_dir)
            build = functools.partial(Qwen3_5ForCausalLM.from_pretrained, config.model_dir)
        else:
            build = functools.partial(HybridLM.from_torch, TorchHybridLM(config.model))
        self.model = build()
        cp_mesh = mesh["cp"]
        # CP, then --ac (every decoder block recomputes its forward in the backward)
        parallelize_run(self, config, self.model, mesh, cp=cp_mesh.size() > 1 or self.tokenizer is not None)
        self.replica = _Replica(self.model, config, cp_mesh)
        self._grads: list[ms.Tensor] | None = None  # between backward and apply_step
        self.reference = None
        if reference:
            solo = DeviceMesh.from_group(platform, None, [platform.rank()], mesh_dim_name="cp")
            self.reference = _Replica(build(), config, solo)

    def backward(self, shard: ContextParallelBatch, *, scale: float) -> tuple[float, float]:
        loss, grads = self.replica.loss_and_grads(shard, scale)
        if self.world_size > 1:  # summed over the CP group, averaged over the DP groups
            grads = sync_context_parallel_grads(grads, self.mesh, dp_axis="dp")
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        self._grads, norm = clip_grad_norm(grads, clip)
        return loss, norm

    def apply_step(self, *, lr: float) -> None:
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("apply_step without backward: no gradients to apply")
        self.replica.optimizer.step(grads, lr)

    def discard_step(self) -> None:
        self._grads = None

    def reference_step(self, whole: ContextParallelBatch, *, lr: float) -> float:
        assert self.reference is not None
        loss, grads = self.reference.loss_and_grads(whole, 1.0)
        self.reference.step(grads, lr)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """``model`` as a torch state dict (the torch model's names), ``optimizer`` :class:`AdamW`'s."""
        model = {name: torch.from_numpy(p.asnumpy().copy()) for name, p in self.model.parameters_and_names()}
        return {"model": model, "optimizer": self.replica.optimizer.state_dict()}

    def load_state_dict(self, path: str, parts: dict[str, Any]) -> None:
        if parts["optimizer"].get("format") != ADAMW_FORMAT:
            raise ValueError(
                f"checkpoint {path} holds torch's AdamW state, not MindSpore's {ADAMW_FORMAT!r} (written "
                "by the torch trainer?); resume it with HP_PLATFORM=cpu|cuda|npu, or load only its model part"
            )
        for replica in (self.replica, self.reference):
            if replica is not None:
                load_torch_state_dict(replica.model, parts["model"])
                replica.optimizer.load_state_dict(parts["optimizer"])

    def save_shards(self, directory: Path, *, background: bool) -> Future | None:
        """Every rank writes its part of the replicated state (:mod:`~hyperpar_gdn.train.checkpoints.replicated_shards`); the
        ``model`` part keeps the torch names, the ``optimizer`` part is :meth:`AdamW.shard_state`."""
        state = {
            "model": {name: _leaf(p) for name, p in self.model.parameters_and_names()},
            "optimizer": self.replica.optimizer.shard_state(_leaf),
        }
        return write_replicated_shards(
            state,
            directory / STATE_DIR,
            rank=self.rank,
            world_size=self.world_size,
            max_over_ranks=self.max_over_ranks,
            background=background,
        )

    def load_shards(self, path: str, shards: str, *, layout: str) -> None:
        """Every rank reads every part (the state is whole on each rank), at any CP or DP size."""
        if layout != REPLICATED_LAYOUT:
            raise ValueError(
                f"checkpoint {path} is sharded by torch's DCP (layout {layout!r}, torch's AdamW state): "
                "resume it with HP_PLATFORM=cpu|cuda|npu, or convert it (python -m "
                "hyperpar_gdn.train.checkpoints.convert --to whole) and load only its model part"
            )
        self.load_state_dict(path, load_whole_state(Path(shards), layout))

    def exporter(self, out: str) -> Callable[[], None]:
        """Parameters are whole on every rank (no FSDP here): rank 0 writes the directory."""
        return lambda: export_model_dir(self.model, self.tokenizer, out)

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def model_config(self) -> dict[str, Any]:
        return self.model.config.to_dict() if self.tokenizer is not None else self.config.model.to_dict()

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        # float64 for loss sums and statistics, float32 on Ascend (as the torch backend on NPUs)
        dtype = ms.float32 if getattr(self.platform, "device_target", "CPU") == "Ascend" else ms.float64
        totals = self.platform.collectives.all_reduce_sum(
            ms.Tensor(np.asarray(values, np.float64)).astype(dtype), None
        )
        return [float(v) for v in totals.asnumpy()]

    def peak_memory(self) -> tuple[int, str]:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"

    # synchronize: PyNative with launch_blocking (the platform's setting) has finished every kernel


class MindSporeTrainer(Trainer):
    """:class:`~hyperpar_gdn.train.loop.trainer.Trainer` with :class:`MindSporeBackend`: the same options,
    batches, loss, logging and metrics; ``HP_PLATFORM=mindspore msrun ... scripts/train.py`` builds
    this one. Used as :class:`~hyperpar_gdn.train.loop.trainer.Trainer` is (see its example: build, train,
    close), with ``HP_PLATFORM=mindspore`` under ``msrun``.
    """

    backend_class = MindSporeBackend
