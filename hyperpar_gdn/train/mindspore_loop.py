"""The training loop on MindSpore (PyNative, MCCL on CPU / HCCL on Ascend under ``msrun``).

The same run as :class:`hyperpar_gdn.train.loop.Trainer`, and the same code wherever it is not
framework maths: options (:class:`TrainConfig`), batches (:mod:`.data`, so both platforms draw the
very same tokens), logging, parity check, summary and metrics (inherited). What differs:

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
  own state (format :data:`ADAMW_FORMAT`), so a run resumes on the platform that saved it.
"""

from __future__ import annotations

import functools
import resource
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
import torch
from mindspore import ops

from hyperpar_gdn.distributed.decoder_layers import text_model_of
from hyperpar_gdn.distributed.grads import sync_context_parallel_grads
from hyperpar_gdn.integrations.transformers.model_dir import export_model_dir, load_tokenizer
from hyperpar_gdn.models.lm import HybridLM as TorchHybridLM
from hyperpar_gdn.models.mindspore import HybridLM, Qwen3_5ForCausalLM, load_torch_state_dict
from hyperpar_gdn.ops.lm_loss import lm_loss_sum
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.data import Batch, RankBatch, rank_batch
from hyperpar_gdn.train.loop import Trainer

__all__ = ["ADAMW_FORMAT", "AdamW", "MindSporeTrainer", "clip_grad_norm", "library_adamw_class"]

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


class _Replica:
    """A model, its optimizer and its loss-and-gradient function."""

    def __init__(self, model: HybridLM | Qwen3_5ForCausalLM, config: TrainConfig) -> None:
        self.model = model
        named = [(name, p) for name, p in model.parameters_and_names() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = AdamW(self.params, weight_decay=config.weight_decay, names=[n for n, _ in named])

        def loss_fn(
            inputs: ms.Tensor, labels: ms.Tensor, scale: ms.Tensor, cu_seqlens: ms.Tensor | None
        ) -> tuple[ms.Tensor, ms.Tensor]:
            # the chunked LM loss: the [rows, T_local, V] logits are never held; labels -100: no loss
            hidden = model.final_hidden_states(inputs, cu_seqlens)
            loss_sum = lm_loss_sum(hidden, model.head_weight, labels)
            return loss_sum * scale, loss_sum

        self.value_and_grad = ms.value_and_grad(loss_fn, None, self.params, has_aux=True)

    def loss_and_grads(self, part: RankBatch, scale: float) -> tuple[ms.Tensor, list[ms.Tensor]]:
        """(sum of token losses, gradients of that sum times ``scale``)."""
        cu = None if part.cu_seqlens is None else ms.Tensor(part.cu_seqlens.numpy())
        (_, loss_sum), grads = self.value_and_grad(
            ms.Tensor(part.inputs.numpy()), ms.Tensor(part.labels.numpy()), ms.Tensor(scale, ms.float32), cu
        )
        return loss_sum, list(grads)

    def step(self, grads: Sequence[ms.Tensor], config: TrainConfig, step: int) -> None:
        """Clip, the learning rate of ``step`` (1-based, linear warmup), AdamW."""
        if config.grad_clip > 0:
            grads, _ = clip_grad_norm(grads, config.grad_clip)
        scale = min(1.0, step / config.warmup_steps) if config.warmup_steps else 1.0
        self.optimizer.step(grads, config.lr * scale)


class MindSporeTrainer(Trainer):
    """:class:`~hyperpar_gdn.train.loop.Trainer` on MindSpore: the same options, batches, loss,
    logging and metrics; ``HP_PLATFORM=mindspore msrun ... scripts/train.py`` builds this one.

    Example::

        trainer = MindSporeTrainer(TrainConfig(cp_mode="p2p", steps=10, seq_len=64, batch_size=4))
        try:
            result = trainer.train()
        finally:
            trainer.close()
    """

    platforms = ("mindspore",)

    def __init__(self, config: TrainConfig) -> None:
        if config.dtype != "fp32":  # on every rank, before the process group
            raise NotImplementedError(BF16_REFUSED.format(dtype=config.dtype))
        super().__init__(config)

    def _unsupported(self, name: str) -> str:
        return f"MindSporeTrainer needs HP_PLATFORM=mindspore (got {name}); use Trainer for torch"

    def _apply_sharding(self) -> None:
        """``--ac``: every decoder block recomputes its forward in the backward (``Cell.recompute``)."""
        if self.config.fsdp:
            raise NotImplementedError(
                "--fsdp is torch's FSDP2; on MindSpore parameters stay replicated (use --ac to save memory)"
            )
        if self.config.ac:
            for block in text_model_of(self.model).layers:
                block.recompute()

    def _build_model(self) -> None:
        """The MindSpore model (from the torch Trainer's initial weights, seeded by ``_build``, or
        from ``--model DIR``), its replica with the optimizer, and the rank-0 copy for --check-parity."""
        config = self.config
        self.tokenizer = None
        if config.model_dir is not None:
            self.tokenizer = load_tokenizer(config.model_dir)
            build = functools.partial(Qwen3_5ForCausalLM.from_pretrained, config.model_dir)
        else:
            build = functools.partial(HybridLM.from_torch, TorchHybridLM(config.model))
        self.model = build()
        self.replica = _Replica(self.model, config)
        self.reference = None
        if config.check_parity and self.rank == 0:
            self.reference = _Replica(build(), config)

    def _train_step(self, batch: Batch) -> float:
        """One step of the (dp, cp)-parallel model; returns the mean loss over the global batch."""
        part = rank_batch(
            batch,
            dp_rank=self.dp_rank,
            dp_size=self.dp,
            cp_rank=self.cp_rank,
            cp_size=self.cp,
            doc_boundaries=self.config.doc_boundaries,
            layout=self.config.token_layout(),
        )
        dtype = self._stat_dtype()
        count = ms.Tensor([float((part.labels != -100).sum())], dtype)
        total = float(self.comm.all_reduce_sum(count, None).asnumpy()[0])  # labelled tokens, all ranks
        # sum / all labelled tokens, times dp: gradients are summed over CP and averaged over DP
        loss_sum, grads = self.replica.loss_and_grads(part, self.dp / total)
        grads = self._sync_grads(grads)
        self.replica.step(grads, self.config, self.step + 1)
        loss_total = self.comm.all_reduce_sum(loss_sum.astype(dtype).reshape(1), None).asnumpy()[0]
        return float(loss_total / total)

    def _sync_grads(self, grads: list[ms.Tensor]) -> list[ms.Tensor]:
        """Sum the gradient shares over the CP group, then average over the DP groups."""
        if self.cp == 1 and self.dp == 1:
            return grads
        return sync_context_parallel_grads(grads, self.mesh, dp_axis="dp")

    def _reference_step(self, batch: Batch) -> float:
        """The same step without any parallelism, on the whole global batch (rank 0 only)."""
        assert self.reference is not None
        part = rank_batch(
            batch, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1, doc_boundaries=self.config.doc_boundaries
        )
        count = int((part.labels != -100).sum())
        loss_sum, grads = self.reference.loss_and_grads(part, 1.0 / count)
        self.reference.step(grads, self.config, self.step)
        return float(loss_sum.asnumpy()) / count

    def _checkpoint_parts(self) -> dict[str, Any]:
        """As the torch trainer's; ``model`` is a torch state dict (the torch model's names)."""
        model = {name: torch.from_numpy(p.asnumpy().copy()) for name, p in self.model.parameters_and_names()}
        return {
            "model": model,
            "optimizer": self.replica.optimizer.state_dict(),
            "data": self.sampler.state_dict(),
            "train": {"step": self.step, "rng_cpu": torch.get_rng_state()},
        }

    def _load_parts(self, path: str, parts: dict[str, Any]) -> None:
        if parts["optimizer"].get("format") != ADAMW_FORMAT:
            raise ValueError(
                f"checkpoint {path} holds torch's AdamW state, not MindSpore's {ADAMW_FORMAT!r} (written "
                "by the torch trainer?); resume it with HP_PLATFORM=cpu|cuda|npu, or load only its model part"
            )
        for replica in (self.replica, self.reference):
            if replica is not None:
                load_torch_state_dict(replica.model, parts["model"])
                replica.optimizer.load_state_dict(parts["optimizer"])

    def _export(self, out: str) -> None:
        """Parameters are whole on every rank (no FSDP here): rank 0 writes the directory."""
        self._on_rank_0(
            lambda: export_model_dir(self.model, self.tokenizer, out), f"export the model to {out}"
        )

    def _max_over_ranks(self, value: int) -> int:
        slots = np.zeros(self.world_size, np.float64)
        slots[self.rank] = value
        total = self.comm.all_reduce_sum(ms.Tensor(slots).astype(self._stat_dtype()), None)
        return int(total.asnumpy().max())

    def _stat_dtype(self) -> ms.Type:
        """float64 for loss sums and statistics, float32 on Ascend (as the torch trainer on NPUs)."""
        return ms.float32 if getattr(self.platform, "device_target", "CPU") == "Ascend" else ms.float64

    def _synchronize(self) -> None:
        """PyNative with launch_blocking (the platform's setting) has finished every kernel."""

    def _peak_memory(self) -> tuple[int, str]:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"
