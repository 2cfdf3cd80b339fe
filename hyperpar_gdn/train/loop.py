"""The training loop: build (process groups, mesh, model, optimizer, data, checkpoint), train, close.

Parallelism: the world is a 2-D mesh ``(dp, cp)``. Every rank of a CP group holds a contiguous
``1/cp`` of each sequence of its DP replica's rows (or of their packed row, with documents); the
model's mixers are context parallel, the rest of the model works token by token. Each rank's loss
term is ``dp x sum of its token losses / labelled tokens of the global batch``; its parameter
gradients are its share, summed over the CP group and then averaged over the DP groups (by
FSDP's reduce-scatter under ``--fsdp``). The result is the gradient of the mean loss over every
labelled token of the global batch: the same step as one device on the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar_gdn.distributed.grads import sync_context_parallel_grads
from hyperpar_gdn.distributed.mesh import DeviceMesh, init_device_mesh
from hyperpar_gdn.distributed.parallelize import apply_context_parallel
from hyperpar_gdn.integrations.transformers.lm_head import hidden_and_head
from hyperpar_gdn.integrations.transformers.model_dir import export_model_dir, load_model_dir
from hyperpar_gdn.models.lm import HybridLM
from hyperpar_gdn.ops.lm_loss import lm_loss_sum
from hyperpar_gdn.platform import get_platform, platform_name
from hyperpar_gdn.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_incomplete,
    save_checkpoint,
    write_atomic,
)
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.data import Batch, BatchSampler, RankBatch, load_stream, rank_batch
from hyperpar_gdn.train.header import run_header
from hyperpar_gdn.train.log import logger, setup_logging
from hyperpar_gdn.train.sharding import (
    apply_activation_checkpointing,
    apply_fsdp,
    full_model_state_dict,
    full_state_dicts,
    load_full_state_dicts,
)

SUPPORTED_PLATFORMS = ("cpu", "cuda", "npu")
# Options a resumed run must share with its checkpoint to draw the same batches and shapes.
_SAME_STREAM = ("model_size", "model_dir", "seq_len", "batch_size", "seed", "data")
# Options that change the loss curve if they differ (a warning only).
_SAME_CURVE = ("lr", "warmup_steps", "weight_decay", "grad_clip", "doc_boundaries", "dtype")


@dataclass
class StepRecord:
    step: int
    loss: float
    seconds: float
    tokens_per_s: float
    peak_memory_bytes: int
    reference_loss: float | None = None


@dataclass
class TrainResult:
    """What a run did; rank 0's view (other ranks hold the same losses and parity verdict)."""

    records: list[StepRecord] = field(default_factory=list)
    start_step: int = 0
    wall_s: float = 0.0
    peak_memory_bytes: int = 0  # the largest over ranks
    memory_kind: str = ""
    parity_max_diff: float | None = None
    parity_first_bad_step: int | None = None
    parity_ok: bool = True

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def tokens_per_s(self) -> float:
        """Mean over the steps after the first (which includes one-off start-up work)."""
        timed = self.records[1:] or self.records
        return sum(r.tokens_per_s for r in timed) / max(len(timed), 1)


class Trainer:
    """Builds everything in its constructor; :meth:`train` runs to ``config.steps``; :meth:`close`
    releases the process group if this trainer created it."""

    platforms: tuple[str, ...] = SUPPORTED_PLATFORMS

    def _unsupported(self, name: str) -> str:
        return (
            f"scripts/train.py trains on PyTorch only: HP_PLATFORM={' / '.join(SUPPORTED_PLATFORMS)} "
            f"is supported, HP_PLATFORM={name} is not (for mindspore use "
            "hyperpar_gdn.train.mindspore_loop.MindSporeTrainer, which scripts/train.py picks)"
        )

    def __init__(self, config: TrainConfig) -> None:
        name = platform_name()
        if name not in self.platforms:
            raise NotImplementedError(self._unsupported(name))
        self.config = config
        self.platform = get_platform(name)
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
        self.dp, self.cp = config.layout(self.world_size)
        self.mesh = init_device_mesh(self.platform.name, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
        self.dp_rank, self.cp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("cp")
        self.comm = self.platform.collectives
        self.device = self.platform.device

        torch.manual_seed(config.seed)  # the initial weights, on every platform
        self._build_model()
        if (
            self.cp > 1 or self.tokenizer is not None
        ):  # transformers' own layers would drop cu_seqlens on a CPU
            cp_layout = config.token_layout()
            apply_context_parallel(self.model, self.mesh["cp"], mode=config.cp_mode, layout=cp_layout)
        self._apply_sharding()
        self.sampler = BatchSampler(
            load_stream(config.data, self.tokenizer),
            seq_len=config.seq_len,
            batch_size=config.batch_size,
            seed=config.seed,
        )
        self.step = 0
        if config.resume is not None:
            self._resume(config.resume)
        elif config.save is not None:
            self._auto_resume(config.save)

    def _apply_sharding(self) -> None:
        """Activation checkpointing and FSDP, after context parallelism (see :mod:`.sharding`)."""
        if self.config.ac:
            apply_activation_checkpointing(self.model)
        if self.config.fsdp:
            apply_fsdp(self.model, device_type=self.device.type, dp=self.dp, bf16=self.config.dtype == "bf16")
            self.optimizer = _adamw(self.model, self.config)  # over the sharded parameters

    def _build_model(self) -> None:
        """The model, the rank-0 copy for --check-parity and their optimizers."""
        config = self.config
        self.tokenizer = None
        if config.model_dir is not None:
            self.model, self.tokenizer = load_model_dir(config.model_dir)
            self.model.to(self.device).train()
        else:
            self.model = HybridLM(config.model).to(self.device)
        self.reference = copy.deepcopy(self.model) if config.check_parity and self.rank == 0 else None
        if self.reference is not None and self.tokenizer is not None:  # our layers, on one rank
            solo = DeviceMesh.from_group(self.platform, None, [self.rank], mesh_dim_name="cp")
            apply_context_parallel(self.reference, solo, mode=config.cp_mode)
        self.optimizer = _adamw(self.model, config)
        self.ref_optimizer = None if self.reference is None else _adamw(self.reference, config)

    # --- training ---------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        config = self.config
        result = TrainResult(start_step=self.step)
        tokens_per_step = config.batch_size * config.seq_len
        for line in run_header(
            config,
            platform=self.platform.name,
            world_size=self.world_size,
            dp=self.dp,
            cp=self.cp,
            parameters=self.model.num_parameters(),
            first_step=self.step + 1,
        ):
            logger.info(line)
        start = time.perf_counter()
        while self.step < config.steps:
            batch = self.sampler.next_batch()
            t0 = time.perf_counter()
            loss = self._train_step(batch)
            self._synchronize()
            seconds = time.perf_counter() - t0
            self.step += 1
            memory, result.memory_kind = self._peak_memory()
            record = StepRecord(self.step, loss, seconds, tokens_per_step / seconds, memory)
            if self.reference is not None:
                record.reference_loss = self._reference_step(batch)
            result.records.append(record)
            if self.step % config.log_every == 0 or self.step == config.steps:
                logger.info(_step_line(record, config.steps, result.memory_kind))
            self._maybe_save()
        result.wall_s = time.perf_counter() - start
        if config.export is not None:
            self._export(config.export)
        result.peak_memory_bytes = self._max_over_ranks(self._peak_memory()[0])
        self._finish_parity(result)
        self._summarize(result)
        if config.metrics_json is not None:  # every rank learns if rank 0 could not write it
            self._on_rank_0(
                lambda: write_atomic(
                    Path(config.metrics_json), (json.dumps(self._metrics(result), indent=2) + "\n").encode()
                ),
                f"write --metrics-json {config.metrics_json}",
            )
        return result

    def close(self) -> None:
        if self._owns_group:
            self.platform.destroy()

    def _synchronize(self) -> None:
        _synchronize(self.device)

    def _peak_memory(self) -> tuple[int, str]:
        return peak_memory(self.device)

    def _rank_batch(self, batch: Batch, *, whole: bool = False) -> RankBatch:
        """This rank's part of ``batch`` on the device (``whole``: all of it, for the reference)."""
        part = rank_batch(
            batch,
            dp_rank=0 if whole else self.dp_rank,
            dp_size=1 if whole else self.dp,
            cp_rank=0 if whole else self.cp_rank,
            cp_size=1 if whole else self.cp,
            doc_boundaries=self.config.doc_boundaries,
            layout=self.config.token_layout(),
        )
        cu = None if part.cu_seqlens is None else part.cu_seqlens.to(self.device)
        return RankBatch(part.inputs.to(self.device), part.labels.to(self.device), cu)

    def _train_step(self, batch: Batch) -> float:
        """One step of the (dp, cp)-parallel model; returns the mean loss over the global batch."""
        part = self._rank_batch(batch)
        loss_sum = self._loss_sum(part)
        dtype = _stat_dtype(self.device)
        totals = torch.stack([loss_sum.detach().to(dtype), (part.labels != -100).sum().to(dtype)])
        self.comm.all_reduce_sum(totals, None)  # the loss sum and the labelled tokens of the global batch
        # sum / all labelled tokens, times dp: gradients are summed over CP and averaged over DP
        (loss_sum * (self.dp / totals[1].item())).backward()
        self._sync_gradients()
        _optimizer_step(self.model, self.optimizer, self.config, self.step + 1)
        return (totals[0] / totals[1]).item()

    def _reference_step(self, batch: Batch) -> float:
        """The same step without any parallelism, on the whole global batch (rank 0 only)."""
        assert self.reference is not None and self.ref_optimizer is not None
        part = self._rank_batch(batch, whole=True)
        with self._autocast():
            logits = self._logits(self.reference, part)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), part.labels.reshape(-1))
        loss.backward()
        _optimizer_step(self.reference, self.ref_optimizer, self.config, self.step)
        return loss.item()

    def _loss_sum(self, part: RankBatch) -> torch.Tensor:
        """The sum of this rank's token losses (fp32), from the final hidden states and the head
        weight in token chunks: the ``[rows, T_local, V]`` logits are never held."""
        with self._autocast():
            hidden, head = hidden_and_head(
                self.model, part.inputs, transformers=self.tokenizer is not None, cu_seqlens=part.cu_seqlens
            )
        if self.config.dtype == "bf16":  # the head's matmuls in bf16, the rest of the loss in fp32
            hidden = hidden.to(torch.bfloat16)
        return lm_loss_sum(hidden, head, part.labels)

    def _autocast(self) -> Any:
        """bf16 autocast under ``--dtype bf16`` without FSDP (whose MixedPrecisionPolicy casts)."""
        if self.config.dtype != "bf16" or self.config.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _logits(self, model: torch.nn.Module, part: RankBatch) -> torch.Tensor:
        """``[rows, T_local, V]`` logits of the built-in or a transformers model (which, under
        context parallelism, gets its global positions from apply_context_parallel's hook)."""
        name = "cu_seqlens" if self.tokenizer is None else "cu_seq_lens_q"  # ours / transformers'
        packed = {} if part.cu_seqlens is None else {name: part.cu_seqlens}
        if self.tokenizer is None:
            return model(part.inputs, **packed)
        return model(input_ids=part.inputs, use_cache=False, **packed).logits

    def _sync_gradients(self) -> None:
        """Sum the gradient shares over the CP group, then average over the DP groups."""
        if (self.cp == 1 and self.dp == 1) or self.config.fsdp:  # FSDP reduce-scatters them itself
            return
        sync_context_parallel_grads(self.model, self.mesh, dp_axis="dp")

    # --- checkpoints ------------------------------------------------------------------------------
    def _maybe_save(self) -> None:
        config = self.config
        due = self.step == config.steps or (config.save_every and self.step % config.save_every == 0)
        if config.save is None or not due:
            return

        parts = self._checkpoint_parts()  # every rank: gathering FSDP shards is collective

        def save() -> None:  # the other ranks wait in _on_rank_0 until step-N is renamed into place
            path = save_checkpoint(
                config.save,
                self.step,
                parts,
                meta={"config": config.to_dict(), "world_size": self.world_size, "cp": self.cp},
            )
            logger.info("saved %s", path)
            if config.keep_last:
                for old in prune_checkpoints(config.save, config.keep_last, up_to=self.step):
                    logger.info("removed %s (--keep-last %d)", old, config.keep_last)

        self._on_rank_0(save, f"save the step-{self.step} checkpoint under {config.save}")

    def _export(self, out: str) -> None:
        """Write the trained model as a transformers directory: every rank gathers its shards
        (collective under FSDP), rank 0 writes the directory atomically."""
        state = full_model_state_dict(self.model)
        self._on_rank_0(
            lambda: export_model_dir(self.model, self.tokenizer, out, state_dict=state),
            f"export the model to {out}",
        )

    def _on_rank_0(self, work: Any, what: str) -> None:
        """Run ``work()`` on rank 0; every rank raises if it failed (or they would wait forever)."""
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                work()
            except Exception as err:
                failure = err
        failed = self._max_over_ranks(int(failure is not None))
        if failure is not None:
            raise failure
        if failed:
            raise CheckpointError(f"rank 0 failed to {what}")

    def _auto_resume(self, root: str) -> None:
        """Resume from the newest complete checkpoint under ``--save`` when there is one.

        Rank 0 alone scans and checks ``root`` (falling back past a damaged newest checkpoint) and
        tells the others which step it took; they load that directory, which is complete: a
        ``step-N`` appears only by a rename once all of it is on disk. Every rank learns of a
        failure on any rank before the next collective, so none waits forever.
        """
        found: tuple[Path, int, dict[str, Any], dict[str, Any]] | None = None
        failure: Exception | None = None
        code = 0  # rank 0's verdict: 0 failed, 1 no checkpoint, 2 + N resume from step-N
        if self.rank == 0:
            try:
                for leftover in remove_incomplete(root):
                    logger.warning("removed %s: a save that did not finish", leftover)
                if self.config.auto_resume:
                    found = latest_checkpoint(root, warn=logger.warning)
                    if found is None and (damaged := list_checkpoints(root)):
                        raise CheckpointError(
                            f"every checkpoint under --save {root} ({', '.join(d.name for _, d in damaged)}) "
                            "failed its checks (see the warnings above); repair or move them, or pass "
                            "--no-auto-resume to start over"
                        )
                code = 1 if found is None else 2 + found[1]
            except Exception as err:
                found, code, failure = None, 0, err
        code = self._max_over_ranks(code)
        if code == 0:
            if failure is not None:
                raise failure
            raise CheckpointError(f"rank 0 failed to look for checkpoints under --save {root}")
        if code == 1:
            existing = list_checkpoints(root) if self.rank == 0 else []
            if existing:  # only under --no-auto-resume
                logger.warning(
                    "--no-auto-resume: training from step 1; --save %s already holds %s from an earlier "
                    "run: this run replaces those it saves again, and a run that resumes from %s takes "
                    "the newest there",
                    root,
                    ", ".join(d.name for _, d in existing),
                    root,
                )
            else:
                logger.info("no checkpoint under --save %s: training from step 1", root)
            return
        step = code - 2
        loaded: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        if found is not None:
            loaded = found[1], found[2], found[3]
        else:
            try:
                loaded = load_checkpoint(Path(root) / f"step-{step}")
            except CheckpointError as err:
                logger.error("%s", err)
        if self._max_over_ranks(int(loaded is None)):
            raise CheckpointError(
                f"a rank could not read {Path(root) / f'step-{step}'}, which rank 0 checked "
                "(do all ranks see the same --save directory?)"
            )
        assert loaded is not None
        logger.info(
            "resuming from %s (the newest complete checkpoint under --save)", Path(root) / f"step-{step}"
        )
        self._resume(str(Path(root) / f"step-{step}"), loaded=loaded)

    def _resume(self, path: str, *, loaded: tuple[int, dict[str, Any], dict[str, Any]] | None = None) -> None:
        step, parts, meta = load_checkpoint(path) if loaded is None else loaded
        saved = meta.get("config", {})
        mine = self.config.to_dict()
        stream = [
            f"--{k.replace('_', '-')} {saved.get(k)!r} (now {mine[k]!r})"
            for k in _SAME_STREAM
            if saved.get(k) != mine[k]
        ]
        if stream:
            raise ValueError(
                f"checkpoint {path} was written by a run with different data or shapes: {'; '.join(stream)}"
            )
        curve = [
            f"--{k.replace('_', '-')} {saved.get(k)!r} (now {mine[k]!r})"
            for k in _SAME_CURVE
            if saved.get(k) != mine[k]
        ]
        if curve and self.rank == 0:
            logger.warning("resuming with changed options, the loss curve will differ: %s", "; ".join(curve))
        if step >= self.config.steps:
            how = "--resume" if loaded is None else "the newest checkpoint under --save,"
            raise ValueError(
                f"{how} {path} is at step {step}; --steps {self.config.steps} leaves nothing to train"
                + ("" if loaded is None else " (raise --steps, or pass --no-auto-resume to start over)")
            )
        self._load_parts(path, parts)
        self.sampler.load_state_dict(parts["data"])
        torch.set_rng_state(parts["train"]["rng_cpu"])
        self.step = step
        logger.info("resumed from %s at step %d", path, step)

    def _checkpoint_parts(self) -> dict[str, Any]:
        """The named parts of a checkpoint (``torch.save``-able, tensors only for the loader)."""
        model, optimizer = full_state_dicts(self.model, self.optimizer)
        return {
            "model": model,
            "optimizer": optimizer,
            "data": self.sampler.state_dict(),
            "train": {"step": self.step, "rng_cpu": torch.get_rng_state()},
        }

    def _load_parts(self, path: str, parts: dict[str, Any]) -> None:
        """Load the model and optimizer parts (and the reference's, under --check-parity)."""
        if "param_groups" not in parts["optimizer"]:
            raise ValueError(
                f"checkpoint {path} holds no torch AdamW state (optimizer format "
                f"{parts['optimizer'].get('format')!r}: written on MindSpore?); resume it with "
                "HP_PLATFORM=mindspore, or load only its model part"
            )
        for model, optimizer in ((self.model, self.optimizer), (self.reference, self.ref_optimizer)):
            if model is not None and optimizer is not None:
                load_full_state_dicts(model, optimizer, parts["model"], parts["optimizer"])

    # --- reporting --------------------------------------------------------------------------------
    def _max_over_ranks(self, value: int) -> int:
        slots = torch.zeros(self.world_size, dtype=_stat_dtype(self.device), device=self.device)
        slots[self.rank] = value
        self.comm.all_reduce_sum(slots, None)
        return int(slots.max().item())

    def _finish_parity(self, result: TrainResult) -> None:
        if not self.config.check_parity:
            return
        failed = 0
        if self.rank == 0:
            diffs = {
                r.step: abs(r.loss - r.reference_loss) for r in result.records if r.reference_loss is not None
            }
            result.parity_max_diff = max(diffs.values(), default=0.0)
            bad = [
                step for step, d in diffs.items() if not (math.isfinite(d) and d <= self.config.parity_tol)
            ]
            result.parity_first_bad_step = bad[0] if bad else None
            failed = int(bool(bad))
        result.parity_ok = not self._max_over_ranks(failed)

    def _summarize(self, result: TrainResult) -> None:
        if not result.records:
            return
        first, last = result.records[0], result.records[-1]
        logger.info(
            "done: steps %d..%d in %.1f s | loss %.4f -> %.4f | %s tok/s | peak %s (%s, max over ranks)",
            first.step,
            last.step,
            result.wall_s,
            first.loss,
            last.loss,
            f"{result.tokens_per_s:,.0f}",
            _mib(result.peak_memory_bytes),
            result.memory_kind,
        )
        if result.parity_max_diff is not None:
            verdict = "OK" if result.parity_ok else "FAILED"
            logger.info(
                "parity %s: largest |loss(cp) - loss(no cp)| over %d steps = %.3g (--parity-tol %.3g)",
                verdict,
                len(result.records),
                result.parity_max_diff,
                self.config.parity_tol,
            )
            if result.parity_first_bad_step is not None:
                logger.info(
                    "the difference first exceeded the tolerance at step %d. A large first-step difference "
                    "is a CP error; one that grows over many steps is two runs drifting apart (training "
                    "amplifies rounding differences; see docs/training.md)",
                    result.parity_first_bad_step,
                )

    def _metrics(self, result: TrainResult) -> dict[str, Any]:
        parity = None
        if self.config.check_parity:
            parity = {
                "reference_losses": [r.reference_loss for r in result.records],
                "max_abs_diff": result.parity_max_diff,
                "first_step_above_tolerance": result.parity_first_bad_step,
                "tolerance": self.config.parity_tol,
                "ok": result.parity_ok,
            }
        return {
            "losses": result.losses,
            "steps": [r.step for r in result.records],
            "start_step": result.start_step,
            "step_seconds": [r.seconds for r in result.records],
            "tokens_per_s_per_step": [r.tokens_per_s for r in result.records],
            "tokens_per_s": result.tokens_per_s,
            "peak_memory_bytes": result.peak_memory_bytes,
            "memory_kind": result.memory_kind,
            "wall_s": result.wall_s,
            "platform": self.platform.name,
            "world_size": self.world_size,
            "dp_size": self.dp,
            "cp_size": self.cp,
            "num_parameters": self.model.num_parameters(),
            "parity": parity,
            "config": asdict(self.config),
            "model": self.model.config.to_dict()
            if self.tokenizer is not None
            else self.config.model.to_dict(),
        }


def _adamw(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (>= 2-D) only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def _optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, step: int
) -> None:
    """Clip, set the learning rate of ``step`` (1-based), step, clear the gradients."""
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    scale = min(1.0, step / config.warmup_steps) if config.warmup_steps else 1.0
    for group in optimizer.param_groups:
        group["lr"] = config.lr * scale
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): the allocator's peak on an accelerator, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "allocated"
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device), "allocated"  # type: ignore[attr-defined]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def _stat_dtype(device: torch.device) -> torch.dtype:
    """float64 for loss sums and statistics, but float32 on NPUs (HCCL reduces fewer dtypes)."""
    return torch.float32 if device.type == "npu" else torch.float64


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _step_line(record: StepRecord, steps: int, memory_kind: str) -> str:
    width = len(str(steps))
    line = (
        f"step {record.step:>{width}}/{steps} | loss {record.loss:.4f} | {record.tokens_per_s:>9,.0f} tok/s | "
        f"peak {_mib(record.peak_memory_bytes)} {memory_kind} | {record.seconds:.3f} s"
    )
    if record.reference_loss is not None:
        line += f" | no-cp {record.reference_loss:.4f} (diff {abs(record.loss - record.reference_loss):.1e})"
    return line
