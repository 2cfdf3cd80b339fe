"""The training loop: build (process group, mesh, backend, data, resume point), train, close.

Parallelism: the world is a 2-D mesh ``(dp, cp)``, under ``--tp`` a 3-D mesh ``(dp, cp, tp)``
whose TP ranks split every decoder block by heads and take the same shard of the batch. Each DP
replica takes ``1/dp`` of the global batch's rows; within its CP group every rank holds its shard of each sequence (or of the replica's
packed row, with documents) in the token layout ``--cp-layout``: by default head_tail (pieces r
and 2cp-1-r of 2cp) when the model has softmax-attention layers, else contiguous. The batch is
cut by the library's ``shard_for_context_parallel`` (:mod:`~hyperpar_gdn.train.data.rank_batches`) and the loss is its
``context_parallel_lm_loss``: a rank's token losses over its CP group's labelled tokens. The
trainer scales it by ``dp x (the replica's labelled tokens) / (the global batch's)``, so that the
gradients, summed over the CP group and averaged over the DP groups (by FSDP's reduce-scatter
under ``--fsdp``), are those of the mean loss over every labelled token of the global batch: the
same step as one device on the whole batch.

The framework enters as a :class:`~hyperpar_gdn.train.backends.base.TrainBackend`: :class:`Trainer`
uses torch's, :class:`~hyperpar_gdn.train.backends.mindspore_backend.MindSporeTrainer` MindSpore's. The
components: :mod:`~hyperpar_gdn.train.backends.optim` (AdamW settings, warm-up), :mod:`~hyperpar_gdn.train.checkpoints.resume`, :mod:`.metrics`, :mod:`.parity`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hyperpar_gdn.distributed.mesh import DeviceMesh, init_device_mesh
from hyperpar_gdn.platform import get_platform, platform_name
from hyperpar_gdn.train.backends.base import TrainBackend
from hyperpar_gdn.train.backends.optim import learning_rate
from hyperpar_gdn.train.backends.torch_backend import TorchBackend
from hyperpar_gdn.train.checkpoints.directory import write_atomic
from hyperpar_gdn.train.checkpoints.resume import find_resume_point
from hyperpar_gdn.train.checkpoints.saves import CheckpointWriter, on_rank_0
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.data.global_batches import Batch, BatchSampler, check_vocabulary, load_stream
from hyperpar_gdn.train.data.rank_batches import cut_batch, replica_rows
from hyperpar_gdn.train.loop.callbacks import TrainCallback
from hyperpar_gdn.train.loop.faults import (
    BadStepGuard,
    RankTimeoutError,
    is_collective_timeout,
    is_finite,
    timeout_message,
)
from hyperpar_gdn.train.loop.header import run_header
from hyperpar_gdn.train.loop.log import logger, setup_logging
from hyperpar_gdn.train.loop.metrics import (
    StepRecord,
    TrainResult,
    metrics_document,
    step_line,
    summary_lines,
)
from hyperpar_gdn.train.loop.parity import finish_parity
from hyperpar_gdn.train.memory_check import check_memory

__all__ = ["StepRecord", "TrainResult", "Trainer"]

ROLL_CALL_S = 2.0  # after a collective timeout: how long the ranks still answering wait for the rest


class Trainer:
    """Builds everything in its constructor; :meth:`train` runs to ``config.steps``; :meth:`close`
    releases the process group if this trainer created it. ``callbacks``: hooks into the loop
    (:class:`~hyperpar_gdn.train.loop.callbacks.TrainCallback`), called on every rank.

    Example::

        trainer = Trainer(TrainConfig(cp_mode="p2p", steps=10, seq_len=64, batch_size=4))
        try:
            result = trainer.train()
        finally:
            trainer.close()
    """

    backend_class: type[TrainBackend] = TorchBackend

    def __init__(self, config: TrainConfig, *, callbacks: Sequence[TrainCallback] = ()) -> None:
        name = platform_name()
        self.backend_class.check(config, name)  # on every rank, before the process group
        if config.plan:
            raise ValueError(
                "--plan prints the memory plan (scripts/train.py) and trains nothing; a Trainer needs plan=False"
            )
        self.config = config
        self.callbacks = tuple(callbacks)
        self.platform = get_platform(name)  # an unusable platform is refused here, by name
        check_memory(config, platform=name)  # every rank: a run over its memory budget is refused here
        self._owns_group = not self.platform.is_initialized()
        self.platform.init_distributed(timeout_s=config.timeout_s)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        config = self.config
        self.rank, self.world_size = self.platform.rank(), self.platform.world_size()
        setup_logging(self.rank)
        self.dp, self.cp, self.tp = config.mesh_shape(self.world_size)
        shape, names = (self.dp, self.cp, self.tp), ("dp", "cp", "tp")
        if self.tp == 1:  # no TP axis (its groups would be one rank each)
            shape, names = shape[:2], names[:2]
        self.mesh = init_device_mesh(self.platform.name, shape, mesh_dim_names=names)
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp") if self.tp > 1 else 0
        self.solo = DeviceMesh.from_group(self.platform, None, [self.rank], mesh_dim_name="cp")
        torch.manual_seed(config.seed)  # the initial weights, on every platform
        reference = config.check_parity and self.rank == 0
        self.backend = self.backend_class(config, self.platform, self.mesh, reference=reference)
        self.model = getattr(self.backend, "model", None)
        self.tokenizer = self.backend.tokenizer
        stream = load_stream(config.data, self.tokenizer)
        check_vocabulary(  # on every rank, before any step
            stream,
            vocab_size=self.backend.vocab_size(),
            tokenizer=self.tokenizer,
            model=config.model_name,
            data=config.data,
        )
        self.sampler = BatchSampler(
            stream,
            seq_len=config.seq_len,
            batch_size=config.batch_size,
            seed=config.seed,
        )
        self.step = 0
        self._timed_out = 0  # roll calls held (each needs its own store keys)
        self.guard = BadStepGuard(max_bad_steps=config.max_bad_steps)
        self.checkpoint_format = config.checkpoint_format or self.backend_class.checkpoint_formats[0]
        meta = {"config": config.to_dict(), "world_size": self.world_size, "cp": self.cp, "tp": self.tp}
        if self.checkpoint_format == "sharded" and self.backend.row_orders():  # under --tp
            meta["row_orders"] = self.backend.row_orders()
        self.writer = CheckpointWriter(config, self.backend, fmt=self.checkpoint_format, meta=meta)
        point = find_resume_point(
            config, rank=self.rank, world_size=self.world_size, max_over_ranks=self.backend.max_over_ranks
        )
        if point is not None:
            if point.shards is not None:
                self.backend.load_shards(point.path, point.shards, layout=point.layout)
            else:
                self.backend.load_state_dict(point.path, point.parts)
            self.sampler.load_state_dict(point.parts["data"])
            torch.set_rng_state(point.parts["train"]["rng_cpu"])
            self.step = point.step
            if config.resume is not None:  # auto resume said "resuming from ..." already
                logger.info("resumed from %s at step %d", point.path, point.step)

    # --- training ---------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        config = self.config
        result = TrainResult(start_step=self.step)
        tokens_per_step = config.batch_size * config.seq_len
        self._log_header(tokens_per_step)
        start = time.perf_counter()
        for callback in self.callbacks:
            callback.on_train_begin(self)
        while self.step < config.steps:
            for callback in self.callbacks:
                callback.on_step_begin(self, self.step + 1)
            batch = self.sampler.next_batch()
            t0 = time.perf_counter()
            with self._timeouts_named(self.step + 1):
                loss, skipped = self._train_step(batch)
                self.backend.synchronize()
            seconds = time.perf_counter() - t0
            self.step += 1
            memory, result.memory_kind = self.backend.peak_memory()
            record = StepRecord(self.step, loss, seconds, tokens_per_step / seconds, memory, skipped=skipped)
            if skipped:
                logger.warning(
                    "step %d skipped: non-finite loss or gradient norm (%d skipped so far, %d in a row; "
                    "--max-bad-steps %d)",
                    self.step,
                    len(self.guard.skipped),
                    self.guard.in_a_row,
                    config.max_bad_steps,
                )
            if config.check_parity and self.rank == 0:
                whole = cut_batch(
                    batch, self.solo, dp_rank=0, dp_size=1, doc_boundaries=config.doc_boundaries
                )
                record.reference_loss = self.backend.reference_step(
                    whole, lr=learning_rate(config, self.step)
                )
            result.records.append(record)
            if self.step % config.log_every == 0 or self.step == config.steps:
                logger.info(step_line(record, config.steps, result.memory_kind))
            with self._timeouts_named(self.step):
                self._maybe_save()
        with self._timeouts_named(self.step):
            self.writer.finish()  # a save still being written in the background is committed
        result.wall_s = time.perf_counter() - start
        if config.export is not None:
            self._on_rank_0(self.backend.exporter(config.export), f"export the model to {config.export}")
        result.peak_memory_bytes = self.backend.max_over_ranks(self.backend.peak_memory()[0])
        if config.check_parity:
            finish_parity(
                result,
                tolerance=config.parity_tol,
                is_rank_0=self.rank == 0,
                max_over_ranks=self.backend.max_over_ranks,
            )
        for line in summary_lines(result, parity_tol=config.parity_tol):
            logger.info("%s", line)
        if config.metrics_json is not None:  # every rank learns if rank 0 could not write it
            document = metrics_document(
                result, run=self._run_facts(), parity_tol=config.parity_tol if config.check_parity else None
            )
            self._on_rank_0(
                lambda: write_atomic(
                    Path(config.metrics_json), (json.dumps(document, indent=2) + "\n").encode()
                ),
                f"write --metrics-json {config.metrics_json}",
            )
        return result

    @contextlib.contextmanager
    def _timeouts_named(self, step: int) -> Iterator[None]:
        """A collective that times out becomes a :class:`RankTimeoutError` naming the step and the
        ranks that did not answer the roll call (``step``: the step being run or saved)."""
        try:
            yield
        except RuntimeError as err:
            if not is_collective_timeout(err):
                raise
            self._timed_out += 1
            silent = self.backend.silent_ranks(f"{step}.{self._timed_out}", wait_s=ROLL_CALL_S)
            message = timeout_message(
                step=step, rank=self.rank, timeout_s=self.config.timeout_s, silent=silent
            )
            raise RankTimeoutError(message) from None

    def close(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:  # a run that stopped with a save in the background
            writer.abandon(timeout_s=self.config.timeout_s)
        if self._owns_group:
            self.platform.destroy()

    def _train_step(self, batch: Batch) -> tuple[float, bool]:
        """One step of the (dp, cp)-parallel model; returns (the mean loss over the global batch,
        whether the step was skipped for a non-finite loss or gradient norm on some rank)."""
        config = self.config
        shard = cut_batch(
            batch,
            self.mesh["cp"],
            dp_rank=self.dp_rank,
            dp_size=self.dp,
            doc_boundaries=config.doc_boundaries,
            layout=config.token_layout(),
        )
        # labelled tokens of this replica and of the global batch: every rank holds the global batch
        replica = replica_rows(
            batch, dp_rank=self.dp_rank, dp_size=self.dp, doc_boundaries=config.doc_boundaries
        )
        whole = replica_rows(batch, dp_rank=0, dp_size=1, doc_boundaries=config.doc_boundaries)
        mine, total = replica.labelled_tokens, whole.labelled_tokens
        # the CP group's mean -> this replica's share of the global mean, times dp (DP averages)
        scale = self.dp * mine / total
        for callback in self.callbacks:
            scale = callback.loss_scale(self, self.step + 1, scale)
        loss, norm = self.backend.backward(shard, scale=scale)
        # one reduction: the loss sum (each token is on one CP rank, counted on its first TP rank:
        # every TP rank holds the same loss) and the ranks gone non-finite
        # (plus the rank's share of the load-balancing loss over the global batch, if any)
        share = loss * mine + self.backend.aux_share * total if self.tp_rank == 0 else 0.0
        loss_sum, bad_ranks = self.backend.sum_over_ranks([share, float(not is_finite(loss, norm))])
        if bad_ranks > 0:
            self.backend.discard_step()
        if self.guard.record(step=self.step + 1, bad_ranks=round(bad_ranks)):
            return loss_sum / total, True
        self.backend.apply_step(lr=learning_rate(config, self.step + 1))
        return loss_sum / total, False

    def _log_header(self, tokens_per_step: int) -> None:
        """The run header (:func:`~hyperpar_gdn.train.loop.header.run_header`), on rank 0."""
        plan = getattr(self.backend, "cp_plan", None)
        for line in run_header(
            self.config,
            platform=self.platform.name,
            world_size=self.world_size,
            dp=self.dp,
            cp=self.cp,
            tp=self.tp,
            parameters=self.backend.num_parameters(),
            first_step=self.step + 1,
            cp_mode=None if plan is None else self.backend.cp_mode,
            model_config=self.backend.model_config(),
        ):
            logger.info(line)
        if plan is not None:
            # the cost model's whole ranking is long: its first clause here (what was priced)
            priced = plan.reason.split(": ", 1)[0].removeprefix(f"mode {plan.mode} ")
            logger.info(
                "--cp-mode auto chose %s: %s (every mode's cost: plan_context_parallel)",
                self.backend.cp_mode,
                priced,
            )

    def _run_facts(self) -> dict[str, Any]:
        return {
            "platform": self.platform.name,
            "world_size": self.world_size,
            "dp_size": self.dp,
            "cp_size": self.cp,
            "tp_size": self.tp,
            "num_parameters": self.backend.num_parameters(),
            "config": self.config.to_dict(),
            "model": self.backend.model_config(),
        }

    # --- checkpoints ------------------------------------------------------------------------------
    def _saving_due(self) -> bool:
        config = self.config
        due = self.step == config.steps or (config.save_every and self.step % config.save_every == 0)
        return config.save is not None and bool(due)

    def _maybe_save(self) -> None:
        if not self._saving_due():
            return
        small = {
            "data": self.sampler.state_dict(),
            "train": {"step": self.step, "rng_cpu": torch.get_rng_state()},
        }
        self.writer.save(self.step, small)

    def _on_rank_0(self, work: Any, what: str) -> None:
        """Run ``work()`` on rank 0; every rank learns if it failed (:func:`~hyperpar_gdn.train.checkpoints.saves.on_rank_0`)."""
        on_rank_0(work, what, backend=self.backend, policy=self.config.on_save_error)
