"""The MindSpore half of a training run (PyNative, MCCL on CPU / HCCL on Ascend under ``msrun``).

:class:`MindSporeTrainer` is :class:`hyperpar_gdn.train.loop.Trainer` with :class:`MindSporeBackend`:
the same options (:class:`TrainConfig`), batches (:mod:`.data` and :mod:`.batches`, so both
platforms draw and cut the very same tokens), loss (``context_parallel_lm_loss``), logging, resume,
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
- the optimizer is :class:`AdamW`: MindSpore's library AdamW (torch's ``AdamW`` maths) set up as
  torch's (decay on matrices, betas (0.9, 0.95), eps 1e-8), with torch's global-norm clipping;
- checkpoints have the same layout and parts; the ``model`` part is a torch state dict with the
  torch model's names (a torch ``HybridLM`` loads it; for ``--model``, transformers' names), the ``optimizer`` part is :class:`AdamW`'s
  own state (format :data:`ADAMW_FORMAT`), so a run resumes on the platform that saved it;
  sharded by default, as on torch, in the replicated layout (:mod:`.replicated_shards`: the state
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
from mindspore import ops

from hyperpar_gdn.distributed.batch import ContextParallelBatch, context_parallel_lm_loss
from hyperpar_gdn.distributed.decoder_layers import text_model_of
from hyperpar_gdn.distributed.grads import sync_context_parallel_grads
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.integrations.transformers.model_dir import export_model_dir, load_tokenizer
from hyperpar_gdn.models.lm import HybridLM as TorchHybridLM
from hyperpar_gdn.models.mindspore import HybridLM, Qwen3_5ForCausalLM, load_torch_state_dict
from hyperpar_gdn.models.mindspore.weights import DTYPES
from hyperpar_gdn.platform import Platform
from hyperpar_gdn.train.backend import TrainBackend, apply_cp_mode
from hyperpar_gdn.train.checkpoint import REPLICATED_LAYOUT
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.loop import Trainer
from hyperpar_gdn.train.replicated_shards import Leaf, write_replicated_shards
from hyperpar_gdn.train.sharded_checkpoint import STATE_DIR, load_whole_state

__all__ = [
    "ADAMW_FORMAT",
    "AdamW",
    "MindSporeBackend",
    "MindSporeTrainer",
    "clip_grad_norm",
    "library_adamw_class",
]

ADAMW_FORMAT = "hyperpar_gdn.train.mindspore_loop.AdamW/1"
BF16_REFUSED = (
    "--dtype {dtype} trains on torch only: MindSpore 2.10 has no bf16 kernels on CPU for MatMul, "
    "BatchMatMul, Exp, Softmax, Sigmoid, Rsqrt or reductions (measured), and its "
    "auto_mixed_precision does not reach these models' functional maths (amp_level 'auto' leaves "
    "them fp32, 'O1' and 'O2' fail); use --dtype fp32 on MindSpore"
)


def clip_grad_norm(grads: Sequence[ms.Tensor], max_norm: float) -> tuple[list[ms.Tensor], float]:
    """torch's ``clip_grad_norm_``: scale every gradient by ``min(1, max_norm / (norm + 1e-6))``,
    where norm is the 2-norm of all of them together. Returns (gradients, norm before clipping)."""
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be positive")
    squares = [(g.astype(ms.float32) ** 2).sum() for g in grads]
    total = ops.sqrt(ops.stack(squares).sum())
    coef = ops.clamp(ms.Tensor(max_norm, ms.float32) / (total + 1e-6), max=1.0)
    return [g * coef.astype(g.dtype) for g in grads], float(total.asnumpy())


def library_adamw_class() -> type:
    """MindSpore's AdamW for the device target: ``mindspore.mint.optim.AdamW`` on Ascend; on CPU,
    where its ``AdamW`` kernel is missing in 2.10 (``mint.optim.AdamW`` and ``FusedAdamW`` both
    fail with "The kernel AdamW unregistered", measured), ``mindspore.experimental.optim.AdamW``,
    the same torch AdamW arithmetic in composed ops (one compiled graph per step)."""
    if ms.get_context("device_target") == "Ascend":
        from mindspore.mint.optim import AdamW as LibraryAdamW
    else:
        from mindspore.experimental.optim import AdamW as LibraryAdamW
    return LibraryAdamW


class AdamW:
    """MindSpore's library AdamW (:func:`library_adamw_class`) with torch's settings: weight decay
    on parameters with 2 or more dims only (as ``hyperpar_gdn.train.loop`` configures torch's),
    betas (0.9, 0.95), eps 1e-8, the learning rate set every step. :meth:`step` takes the
    gradients in the order of ``params``.

    Args:
        params: the parameters to update (``mindspore.Parameter``).
        weight_decay: decoupled weight decay of the matrices.
        betas, eps: Adam's moment decays and denominator epsilon.
        names: a name per parameter, for :meth:`state_dict` (default: the parameters' own).
    """

    def __init__(
        self,
        params: Sequence[ms.Parameter],
        *,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        names: Sequence[str] | None = None,
    ) -> None:
        self.params = list(params)
        self.names = [p.name for p in self.params] if names is None else list(names)
        if len(self.names) != len(self.params):
            raise ValueError(f"AdamW got {len(self.names)} names for {len(self.params)} parameters")
        decay = [i for i, p in enumerate(self.params) if len(p.shape) >= 2]
        rest = [i for i, p in enumerate(self.params) if len(p.shape) < 2]
        self._order = decay + rest  # the library's parameter order, group by group
        self._slot = {position: slot for slot, position in enumerate(self._order)}
        groups = [
            {"params": [self.params[i] for i in ids], "weight_decay": wd}
            for ids, wd in ((decay, weight_decay), (rest, 0.0))
            if ids
        ]
        self.optimizer = library_adamw_class()(groups, lr=1e-3, betas=betas, eps=eps)
        # the step counter starts at 0 (experimental.optim) or -1 (mint.optim)
        self._step_offset = -int(self.optimizer.state_step.asnumpy().reshape(-1)[0])

    @property
    def steps(self) -> int:
        return int(self.optimizer.state_step.asnumpy().reshape(-1)[0]) + self._step_offset

    @property
    def exp_avg(self) -> list[ms.Tensor]:
        """First moments, in the order of ``params``."""
        return [self.optimizer.exp_avg[self._slot[i]] for i in range(len(self.params))]

    @property
    def exp_avg_sq(self) -> list[ms.Tensor]:
        """Second moments, in the order of ``params``."""
        return [self.optimizer.exp_avg_sq[self._slot[i]] for i in range(len(self.params))]

    def step(self, grads: Sequence[ms.Tensor], lr: float) -> None:
        if len(grads) != len(self.params):
            raise ValueError(f"AdamW.step got {len(grads)} gradients for {len(self.params)} parameters")
        for i, (param, grad) in enumerate(zip(self.params, grads, strict=True)):
            if tuple(grad.shape) != tuple(param.shape):
                raise ValueError(
                    f"AdamW: gradient {i} has shape {tuple(grad.shape)}, its parameter {param.name} "
                    f"{tuple(param.shape)}"
                )
        # A float, not the group's lr Parameter set in place: in 2.10 (measured) a group of two or
        # more parameters then kept updating with a stale rate (0.003 off torch after one change).
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        self.optimizer(tuple(grads[i] for i in self._order))

    def state_dict(self) -> dict[str, Any]:
        """The moments (torch tensors, so ``torch.load(weights_only=True)`` reads them), the step
        count and the parameter names."""
        return {
            "format": ADAMW_FORMAT,
            "steps": self.steps,
            "names": list(self.names),
            "exp_avg": [torch.from_numpy(m.asnumpy().copy()) for m in self.exp_avg],
            "exp_avg_sq": [torch.from_numpy(v.asnumpy().copy()) for v in self.exp_avg_sq],
        }

    def shard_state(self) -> dict[str, Any]:
        """:meth:`state_dict` with :class:`~.replicated_shards.Leaf` moments: nothing is copied
        until a rank reads the moments it saves."""
        return {
            "format": ADAMW_FORMAT,
            "steps": self.steps,
            "names": list(self.names),
            "exp_avg": [_leaf(m) for m in self.exp_avg],
            "exp_avg_sq": [_leaf(v) for v in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the parameter names and shapes must match."""
        if state.get("format") != ADAMW_FORMAT:
            raise ValueError(
                f"optimizer state has format {state.get('format')!r}, not {ADAMW_FORMAT!r} (torch's "
                "AdamW state, from a torch run?): resume it on the platform that saved it"
            )
        if list(state["names"]) != self.names:
            raise ValueError(
                f"optimizer state is for parameters {state['names'][:3]}... ({len(state['names'])}), "
                f"not {self.names[:3]}... ({len(self.names)})"
            )
        for i, (m, v, p) in enumerate(zip(state["exp_avg"], state["exp_avg_sq"], self.params, strict=True)):
            if tuple(m.shape) != tuple(p.shape) or tuple(v.shape) != tuple(p.shape):
                raise ValueError(
                    f"optimizer state of {self.names[i]} has shape {tuple(m.shape)}, not {tuple(p.shape)}"
                )
        for i, p in enumerate(self.params):
            slot = self._slot[i]
            self.optimizer.exp_avg[slot].set_data(ms.Tensor(state["exp_avg"][i].numpy()).astype(p.dtype))
            self.optimizer.exp_avg_sq[slot].set_data(
                ms.Tensor(state["exp_avg_sq"][i].numpy()).astype(p.dtype)
            )
        step = self.optimizer.state_step
        value = np.full(step.shape, int(state["steps"]) - self._step_offset)
        step.set_data(ms.Tensor(value, step.dtype))


# numpy's name of each MindSpore dtype a checkpoint holds (numpy has no bfloat16; nor does training)
_NUMPY_NAMES = {ms_dtype: name for name, ms_dtype in DTYPES.items() if name != "bfloat16"}


def _leaf(tensor: ms.Tensor) -> Leaf:
    """``tensor`` as a :class:`~.replicated_shards.Leaf`: read, it is copied to a host array."""
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
    """:class:`~hyperpar_gdn.train.backend.TrainBackend` on MindSpore (see the module docstring)."""

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
        self.cp_mode, self.cp_plan = config.cp_mode, None
        if cp_mesh.size() > 1 or self.tokenizer is not None:
            apply_cp_mode(self, config, self.model, cp_mesh)
        if config.ac:  # every decoder block recomputes its forward in the backward
            for block in text_model_of(self.model).layers:
                block.recompute()
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
        """Every rank writes its part of the replicated state (:mod:`.replicated_shards`); the
        ``model`` part keeps the torch names, the ``optimizer`` part is :meth:`AdamW.shard_state`."""
        state = {
            "model": {name: _leaf(p) for name, p in self.model.parameters_and_names()},
            "optimizer": self.replica.optimizer.shard_state(),
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
                "hyperpar_gdn.train.convert --to whole) and load only its model part"
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
    """:class:`~hyperpar_gdn.train.loop.Trainer` with :class:`MindSporeBackend`: the same options,
    batches, loss, logging and metrics; ``HP_PLATFORM=mindspore msrun ... scripts/train.py`` builds
    this one.

    Example::

        trainer = MindSporeTrainer(TrainConfig(cp_mode="p2p", steps=10, seq_len=64, batch_size=4))
        try:
            result = trainer.train()
        finally:
            trainer.close()
    """

    backend_class = MindSporeBackend
