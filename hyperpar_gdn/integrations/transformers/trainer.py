"""transformers' ``Trainer`` (and any subclass, TRL's ``SFTTrainer`` among them) under context
parallelism: a few lines added to an existing script::

    trainer = ContextParallelTrainer(model=model, args=args, train_dataset=ds, cp_size=2, cp_mode="p2p")
    trainer.train()

    class CPSFTTrainer(ContextParallelMixin, SFTTrainer): ...   # any other Trainer subclass
    trainer = CPSFTTrainer(model=model, args=sft_config, train_dataset=ds, cp_size=2)

The launched world of W processes is a mesh ``(dp, cp)``, row-major: each CP group is ``cp``
consecutive ranks, ``dp = W / cp``; with ``tp_size`` a mesh ``(dp, cp, tp)``, tp innermost, the
model split by heads over tp before CP (:mod:`.trainer_tp` replaces DDP). What changes against a
plain Trainer:

- data: the loaders shard over the DP ranks only, so every rank of a CP group reads the same
  batches ``[B, T]``; each rank keeps its tokens in the model's layout (``[B, T/cp]``);
- loss: this rank's token sum (:func:`~hyperpar_gdn.ops.lm_loss.lm_loss_sum` on the final hidden
  states and the head weight: no ``[B, T, V]`` logits) over ``num_items_in_batch``, the labelled
  tokens of the global batch (all DP ranks and gradient-accumulation steps), times W: accelerate's
  DDP (or FSDP) averages gradients over all W processes, which turns the CP shares into their sum
  and the DP replicas into their mean. Clipping then sees the whole model's gradient;
- logging and evaluation: the logged loss, grad_norm and eval_loss are one device's values
  (evaluation gathers over the DP ranks only).

Legend: B batch rows, T whole sequence, T/cp a rank's shard, V vocabulary, C hidden.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from transformers import Trainer

from hyperpar_gdn.cli import print_line
from hyperpar_gdn.distributed.batch import IGNORE_INDEX, context_parallel_lm_loss, shard_for_context_parallel
from hyperpar_gdn.distributed.layout import layout_error
from hyperpar_gdn.distributed.mesh import init_device_mesh
from hyperpar_gdn.expert_parallel import load_balancing_loss, record_router_logits
from hyperpar_gdn.integrations.transformers.lm_head import transformers_hidden_and_head
from hyperpar_gdn.integrations.transformers.notices import hide_expected_notices, one_line_if_uncaught
from hyperpar_gdn.integrations.transformers.trainer_checkpoints import (
    check_saved_sizes,
    load_model_shards,
    load_optimizer_shards,
    save_rank_state,
)
from hyperpar_gdn.integrations.transformers.trainer_checks import CPSetup, check_head, check_trainer_setup
from hyperpar_gdn.integrations.transformers.trainer_tp import prepare_without_ddp, sync_grads
from hyperpar_gdn.ops.gdn.kernels import check_kernel, platform_of, resolve_kernel
from hyperpar_gdn.ops.lm_loss import lm_loss_sum
from hyperpar_gdn.parallel import ParallelConfig, parallelize
from hyperpar_gdn.planning.plan import CPPlan

__all__ = ["ContextParallelMixin", "ContextParallelTrainer"]

# the batch keys the CP path reads: transformers' collators (padding, DataCollatorWithFlattening)
# and TRL's (padding-free packing) emit these; the packed-document keys must describe the same
# documents as the position_ids
_BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
_PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_REFUSALS = (ValueError, NotImplementedError, TypeError)  # a set-up the CP path does not serve


class ContextParallelMixin:
    """Context parallelism for a ``Trainer`` subclass: put it first among the bases.

    Keyword-only options (the rest go to the Trainer unchanged):

    - ``cp_size``: ranks per CP group; divides the launched world, the rest is data parallel.
    - ``cp_mode``: the GDN layers' mode, any of :data:`~hyperpar_gdn.planning.plan.MODE_CHOICES`:
      ``"p2p"`` (default), ``"all_gather"``, ``"scan"``, ``"ulysses"``, ``"ulysses_hidden"``, a
      two-level mode with ``cp_inner_size``, or ``"auto"`` (the cost model's choice for
      ``cp_seq_len`` tokens, else ``args.max_length``).
    - ``cp_layout``: ``"head_tail"`` or ``"contiguous"``; None: head_tail when the model has
      softmax-attention layers (equal attention work per rank), else contiguous.
    - ``cp_chunk_size``: chunk of the gated delta rule (64).
    - ``gdn_kernel``: the GDN layers' local kernel, ``"auto"`` (fla's Triton kernels on CUDA and
      Ascend where they import, else ours), ``"fla"`` or ``"native"`` (docs/backends.md).
    - ``tp_size``: tensor-parallel ranks (1: none); the world is ``(dp, cp, tp)``, tp innermost, and
      the model is split by heads and columns (``apply_tensor_parallel``) before CP; the data split
      over dp only.
    - ``ep_size``: expert-parallel ranks (1: none), taken from the dp x cp ranks of each TP index
      (it divides them): every MoE block's routed experts split by expert
      (``apply_expert_parallel``, before tensor parallelism, which then leaves those blocks whole
      over tp); DDP replaced as under ``tp_size``.

    A MoE model whose config sets ``output_router_logits`` trains with the router's
    load-balancing loss times its ``router_aux_loss_coef``, counted over the whole global batch
    (every CP and DP rank): one device's loss and gradients, under ``tp_size`` and ``ep_size`` too.

    Batches ``[B, T]`` need T divisible by cp (2*cp for head_tail): pad with the collator's
    ``pad_to_multiple_of``. Packed rows (``position_ids`` restarting per document, B = 1) train as
    packed documents. ``compute_metrics`` is refused (no rank holds whole logits).
    """

    def __init__(
        self,
        *args: Any,
        cp_size: int,
        cp_mode: str = "p2p",
        cp_layout: str | None = None,
        cp_chunk_size: int = 64,
        cp_inner_size: int | None = None,
        cp_seq_len: int | None = None,
        gdn_kernel: str = "auto",
        tp_size: int = 1,
        ep_size: int = 1,
        **kwargs: Any,
    ) -> None:
        check_kernel(gdn_kernel)
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        try:
            for name in ("compute_metrics", "compute_loss_func", "preprocess_logits_for_metrics"):
                if kwargs.get(name) is not None:
                    raise NotImplementedError(
                        f"{name} is not supported under context parallelism: no rank holds the whole "
                        "logits and the loss is the CP loss; leave it None"
                    )
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.cp_setup: CPSetup = check_trainer_setup(
                model,
                training_args,
                world=world,
                cp_size=cp_size,
                cp_mode=cp_mode,
                cp_layout=cp_layout,
                cp_chunk_size=cp_chunk_size,
                cp_inner_size=cp_inner_size,
                cp_seq_len=cp_seq_len,
                tp_size=tp_size,
                ep_size=ep_size,
                gdn_kernel=gdn_kernel,
            )
        except _REFUSALS as error:
            one_line_if_uncaught(error, name=type(self).__name__)
            raise
        super().__init__(*args, **kwargs)
        setup = self.cp_setup
        device_type = self.args.device.type
        hide_expected_notices(device_type)
        if setup.tp == 1:
            self.cp_mesh = init_device_mesh(device_type, (setup.dp, setup.cp), mesh_dim_names=("dp", "cp"))
        else:
            shape = (setup.dp, setup.cp, setup.tp)
            self.cp_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "cp", "tp"))
        try:
            check_head(self.model)  # a PeftModel too (TRL wraps the model given with peft_config=)
            # the experts over ep of the (dp, cp) ranks of each TP index, the heads over tp (an
            # expert-parallel MoE block stays whole), then the sequence; auto: the cost model's plan
            parallel = ParallelConfig(
                tp=setup.tp,
                ep=setup.ep,
                cp_mode=setup.mode,
                cp_layout=setup.layout,
                cp_inner_size=None if setup.plan is None else setup.plan.inner_size,
                cp_chunk_size=setup.chunk_size,
                gdn_kernel=gdn_kernel,
                seq_len=setup.seq_len,
                bf16=bool(self.args.bf16),
            )
            done = parallelize(self.model, self.cp_mesh, parallel)
            self.ep_mesh = done.ep_mesh
            self.cp_plan: CPPlan = done.cp_plan
        except _REFUSALS as error:
            one_line_if_uncaught(error, name=type(self).__name__)
            raise
        if getattr(self.model.config, "output_router_logits", False):
            self.model.config.output_router_logits = False  # compute_loss adds it over the global batch
        # the loss below divides by num_items_in_batch: the Trainer must count it and not divide
        # the loss by the accumulation steps again
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train`` after one header line on rank 0 (:meth:`cp_header`)."""
        if self.is_world_process_zero():
            print_line(f"{type(self).__name__}: {self.cp_header()}")
        return super().train(*args, **kwargs)

    def cp_header(self) -> str:
        """What runs where, in one line: ``context parallelism: cp 2 x dp 1 (2 processes, cpu),
        mode p2p, layout head_tail, kernel native (...why)`` (``mode auto: <its choice>`` for auto)."""
        setup, plan = self.cp_setup, self.cp_plan
        kernel = resolve_kernel(plan.kernel, platform=platform_of(next(self.model.parameters())))
        mode = plan.mode if setup.plan is not None else f"auto: {plan.mode}"
        inner = "" if plan.inner_size is None else f", inner size {plan.inner_size}"
        tp = "" if setup.tp == 1 else f" x tp {setup.tp}"
        ep = "" if setup.ep == 1 else f", ep {setup.ep} (experts over dp x cp)"
        return (
            f"context parallelism: cp {setup.cp}{tp} x dp {setup.dp} ({setup.world} processes, "
            f"{self.args.device.type}){ep}, mode {mode}{inner}, layout {plan.layout}, kernel {kernel.name} "
            f"({kernel.reason})"
        )

    # --- data ------------------------------------------------------------------------------------

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loader, prepared by accelerate over the DP ranks only (the CP ranks of a
        DP replica read the same batches)."""
        accelerator = self.accelerator
        accelerator.prepare_data_loader = self._prepare_over_dp
        try:
            return super()._get_dataloader(*args, **kwargs)
        finally:
            del accelerator.prepare_data_loader  # back to the class's method

    def _prepare_over_dp(
        self, data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        """accelerate's ``Accelerator.prepare_data_loader`` with ``dp`` processes, this rank's DP index."""
        from accelerate.data_loader import prepare_data_loader

        accelerator = self.accelerator
        if slice_fn_for_dispatch is not None:
            raise NotImplementedError("dispatched batches (slice_fn_for_dispatch) are not supported under CP")
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=self.cp_setup.dp,
            process_index=self.cp_mesh.get_local_rank("dp"),
            split_batches=accelerator.split_batches,
            put_on_device=True if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,  # every process reads its own shard of the data
            even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)  # as accelerate's own prepare: end-of-epoch tracking
        return prepared

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """Labelled tokens of the global batch (every DP replica, every accumulation step).

        The count travels in one all-gather over all processes together with each rank's first
        batch length the layout cannot cut (0 if none), so a bad batch on any rank stops every
        rank here, before the model's collectives."""
        if not batch_samples:
            return None
        counts, bad_length = 0, 0
        for batch in batch_samples:
            labels = batch.get("labels")
            if labels is None:
                raise ValueError(f"a batch without labels (keys {sorted(batch)}): CP training needs labels")
            counts += int(labels[..., 1:].ne(IGNORE_INDEX).sum())
            length = labels.shape[-1]
            if not bad_length and layout_error(self.cp_setup.layout, length, self.cp_setup.cp):
                bad_length = length
        mine = torch.tensor([counts, bad_length], dtype=torch.float64, device=device)
        every = self.accelerator.gather(mine.reshape(1, 2)) if self.cp_setup.world > 1 else mine.reshape(1, 2)
        for rank, (_, length) in enumerate(every.tolist()):
            if length:
                reason = layout_error(self.cp_setup.layout, int(length), self.cp_setup.cp)
                error = ValueError(
                    f"rank {rank}'s batch: {reason}; pad batches with the collator's pad_to_multiple_of="
                    f"{2 * self.cp_setup.cp if self.cp_setup.layout == 'head_tail' else self.cp_setup.cp}"
                )
                one_line_if_uncaught(error, name=type(self).__name__)
                raise error
        return (every[:, 0].sum() / (self.cp_setup.cp * self.cp_setup.tp)).to(torch.float32)

    # --- loss ------------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Training: this rank's term, ``sum of its token losses / num_items_in_batch * dp * cp``.
        Evaluation (``num_items_in_batch`` None): the whole batch's mean loss, on every CP rank."""
        if inputs.get("labels") is None:
            raise ValueError(f"a batch without labels (keys {sorted(inputs)}): CP training needs labels")
        cp_mesh = self.cp_mesh["cp"]
        shard = shard_for_context_parallel(
            cp_mesh,
            inputs["input_ids"],
            labels=inputs["labels"],
            attention_mask=inputs.get("attention_mask"),
            position_ids=inputs.get("position_ids"),
            cu_seqlens=_packed_cu_seqlens(inputs),
            layout=self.cp_setup.layout,
        )
        unwrapped = self.accelerator.unwrap_model(model)
        coef = self.cp_setup.router_coef
        routers = record_router_logits(unwrapped) if coef else contextlib.nullcontext([])
        with routers as router_logits:
            hidden, head_weight = transformers_hidden_and_head(model, unwrapped, shard.model_inputs())
        if num_items_in_batch is None:  # evaluation: the batch mean, the same on every CP rank
            loss = context_parallel_lm_loss(hidden, head_weight, shard.labels, cp_mesh).detach()
            if coef:  # this CP group's share of the batch's load-balancing loss
                loss = loss + coef * self._router_loss(router_logits, shard, (cp_mesh,)).detach()
            if self.cp_setup.cp > 1:
                loss = cp_mesh.platform.collectives.all_reduce_sum(loss.reshape(1), cp_mesh.get_group())[0]
        else:
            scale = self.cp_setup.dp * self.cp_setup.cp  # the world over tp: DDP (or sync_grads) averages
            loss = lm_loss_sum(hidden, head_weight, shard.labels) / num_items_in_batch * scale
            if coef:  # this rank's share of the global batch's load-balancing loss
                meshes = (cp_mesh, self.cp_mesh["dp"])
                aux = coef * self._router_loss(router_logits, shard, meshes) * scale
                loss = loss + _gradient_over(aux, self._router_copies)
        return (loss, {"loss": loss}) if return_outputs else loss

    def _router_loss(self, router_logits: list, shard: Any, meshes: tuple) -> torch.Tensor:
        """This rank's share of the load-balancing loss over the tokens of ``meshes``' ranks."""
        top_k = self.accelerator.unwrap_model(self.model).config.num_experts_per_tok
        return load_balancing_loss(router_logits, top_k=top_k, meshes=meshes, mask=shard.attention_mask)

    @property
    def _router_copies(self) -> int:
        """How many ranks' load-balancing shares reach one router gradient: the TP ranks where the
        MoE blocks are split over tp (every TP rank adds the same share, and the TP styles sum the
        router's and the block input's gradients over them); 1 where each TP rank runs its
        expert-parallel blocks whole (nothing summed over tp)."""
        return self.cp_setup.tp if self.cp_setup.ep == 1 else 1

    # --- tensor or expert parallelism: no DDP, the gradients averaged by sync_grads ---------------

    @property
    def _without_ddp(self) -> bool:
        return self.cp_setup.tp > 1 or self.cp_setup.ep > 1

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self._without_ddp:
            prepare_without_ddp(self.accelerator)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if not self._without_ddp:
            return super()._clip_grad_norm(model)
        from hyperpar_gdn.tensor_parallel.comm import clip_grad_norm_

        sync_grads(model, self.cp_mesh, ep_mesh=self.ep_mesh)
        return clip_grad_norm_(_grads(model), self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """The logged norm; under tp, without clipping, the gradients are averaged here (the Trainer
        calls it before every optimizer step)."""
        if self._without_ddp and grad_norm is None:
            from hyperpar_gdn.tensor_parallel.comm import clip_grad_norm_

            sync_grads(model, self.cp_mesh, ep_mesh=self.ep_mesh)
            grad_norm = clip_grad_norm_(_grads(model), float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``; under tp or ep the whole weights in transformers' layout
        (gathered on every rank, written by rank 0; a checkpoint adds every rank's shards for
        resuming, :mod:`.trainer_checkpoints`)."""
        if not self._without_ddp:
            return super().save_model(output_dir, _internal_call)
        from hyperpar_gdn.tensor_parallel import canonical_state_dict

        self._whole_state = canonical_state_dict(self.accelerator.unwrap_model(self.model))
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            del self._whole_state

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:
            state_dict = getattr(self, "_whole_state", None)
        return super()._save(output_dir, state_dict=state_dict)

    # --- checkpoints: under tp or ep every rank's shards and optimizer state ----------------------

    def _parallel_sizes(self) -> dict[str, int]:
        setup = self.cp_setup
        return {"world": setup.world, "dp": setup.dp, "cp": setup.cp, "tp": setup.tp, "ep": setup.ep}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._without_ddp:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_rank_state(
            output_dir,
            model=self.accelerator.unwrap_model(self.model),
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            sizes=self._parallel_sizes(),
            rank=self.args.process_index,
        )

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        """The sizes checked against the checkpoint's on every rank, before any communication;
        under tp or ep this rank's shards loaded from its own file."""
        try:
            check_saved_sizes(resume_from_checkpoint, self._parallel_sizes(), sharded=self._without_ddp)
        except ValueError as error:
            one_line_if_uncaught(error, name=type(self).__name__)
            raise
        if not self._without_ddp:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        unwrapped = self.accelerator.unwrap_model(self.model if model is None else model)
        load_model_shards(
            resume_from_checkpoint, unwrapped, rank=self.args.process_index, world=self.cp_setup.world
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._without_ddp:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_optimizer_shards(
            checkpoint,
            self.optimizer,
            self.lr_scheduler,
            rank=self.args.process_index,
            world=self.cp_setup.world,
        )

    def _load_best_model(self) -> None:
        """Under tp or ep this rank's shards from the best checkpoint's own file (the whole
        weights' file does not reach the shards)."""
        if not self._without_ddp:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        check_saved_sizes(best, self._parallel_sizes(), sharded=True)
        unwrapped = self.accelerator.unwrap_model(self.model)
        load_model_shards(best, unwrapped, rank=self.args.process_index, world=self.cp_setup.world)

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, None, None]:
        """The batch's loss only: no rank holds the whole logits."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop with its gathers over the DP ranks only (a CP group's ranks hold
        the same batch loss)."""
        self.gather_function = self._gather_over_dp
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics

    def _gather_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of every DP replica, concatenated along dim 0 in DP order."""
        dp_mesh = self.cp_mesh["dp"]
        if dp_mesh.size() == 1:
            return tensor
        stacked = dp_mesh.platform.collectives.all_gather(tensor.contiguous(), dp_mesh.get_group())
        return stacked.reshape(-1, *tensor.shape[1:])


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    """transformers' ``Trainer`` with context parallelism (see :class:`ContextParallelMixin`)::

    trainer = ContextParallelTrainer(model=model, args=args, train_dataset=ds, cp_size=2)
    """


def _packed_cu_seqlens(inputs: dict[str, Any]) -> torch.Tensor | None:
    """The documents ``cu_seq_lens_q`` int ``[N+1]`` of a padding-free batch (TRL's collator), or
    None; its other packed keys must say the same (``shard_for_context_parallel`` checks it
    against the ``position_ids``). Unknown keys are an error."""
    unknown = sorted(set(inputs) - set(_BATCH_KEYS) - set(_PACKED_KEYS))
    if unknown:
        raise ValueError(
            f"batch keys {unknown} are not handled under context parallelism; it reads "
            f"{list(_BATCH_KEYS)} and the packed-document keys {list(_PACKED_KEYS)}"
        )
    cu = inputs.get("cu_seq_lens_q")
    if cu is None:
        present = [key for key in _PACKED_KEYS if key in inputs]
        if present:
            raise ValueError(f"batch keys {present} without cu_seq_lens_q: the packed documents are unknown")
        return None
    lengths = cu.diff()
    derived = {
        "cu_seq_lens_k": cu,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
        "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)[None],
    }
    for key, expected in derived.items():
        given = inputs.get(key)
        same = given is None or (
            given == expected if isinstance(expected, int) else torch.equal(given.long(), expected.long())
        )
        if not same:
            raise ValueError(
                f"batch key {key} does not describe the documents of cu_seq_lens_q={cu.tolist()}"
            )
    return cu


def _gradient_over(x: torch.Tensor, copies: int) -> torch.Tensor:
    """``x`` as its value, with its gradient divided by ``copies``: a term that ``copies`` ranks
    add alike and whose gradients are summed over them (the logged loss keeps the whole value)."""
    if copies == 1:
        return x
    return x / copies + (x - x / copies).detach()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]
