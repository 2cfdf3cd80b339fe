"""The framework as the trainer sees it: one small object per framework (torch, MindSpore).

:class:`~hyperpar_gdn.train.loop.trainer.Trainer` is written once, without framework maths: it draws the
batches, cuts them (:mod:`~hyperpar_gdn.train.data.rank_batches`), keeps the step count, checkpoints, metrics and the parity
check. A :class:`TrainBackend` owns what a framework does differently: the model and its
optimizer, one training step (forward, loss, backward, gradient sync, optimizer step), the no-CP
reference step, the state dicts of a checkpoint, reductions over ranks, peak memory and export.
:class:`~hyperpar_gdn.train.backends.torch_backend.TorchBackend` and
:class:`~hyperpar_gdn.train.backends.mindspore_backend.MindSporeBackend` implement it; a new framework (or a
backend that adds fault handling) implements or extends these methods and nothing else.

The loss of a step, on every backend: this rank's
:func:`~hyperpar_gdn.distributed.batch.context_parallel_lm_loss` (the sum of its token losses over
the labelled tokens of its CP group) times ``scale``, which the trainer sets so that the gradients,
summed over the CP group and averaged over the DP groups, are those of the mean loss over every
labelled token of the global batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from hyperpar_gdn.distributed.batch import ContextParallelBatch
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.platform import Platform
from hyperpar_gdn.train.config import TrainConfig

__all__ = ["TrainBackend", "parallelize_run"]


def parallelize_run(backend: Any, config: TrainConfig, model: Any, mesh: DeviceMesh, *, cp: bool) -> Any:
    """Apply the run's parallelisms to ``model`` over the run's ``mesh`` through
    :func:`~hyperpar_gdn.parallel.compose.parallelize` (the options' one translation into a
    :class:`~hyperpar_gdn.parallel.config.ParallelConfig`) and return what it made; ``cp``: whether
    the mixers become context-parallel layers (a transformers model gets ours even at cp 1). Sets
    ``backend.cp_mode`` (the mode run) and ``backend.cp_plan`` (for --cp-mode auto the cost
    model's plan, its ``reason`` saying why; else None)."""
    from hyperpar_gdn.parallel import ParallelConfig, parallelize

    auto = config.cp_mode == "auto"
    cp_options = (
        {
            "cp_mode": config.cp_mode,
            "cp_layout": config.token_layout(),
            "cp_inner_size": config.cp_inner_size,
            "gdn_kernel": config.gdn_kernel,
            "seq_len": config.seq_len if auto else None,
        }
        if cp
        else {}
    )
    parallel = ParallelConfig(
        tp=config.tp,
        ep=config.ep,
        activation_checkpointing=config.ac,
        fsdp=config.fsdp,
        bf16=config.dtype == "bf16",
        **cp_options,
    )
    done = parallelize(model, mesh, parallel)
    backend.cp_plan = done.cp_plan if auto else None
    backend.cp_mode = config.cp_mode if done.cp_plan is None else done.cp_plan.mode
    return done


class TrainBackend(ABC):
    """A framework's half of a training run. Built by the trainer once the process group and the
    ``(dp, cp)`` mesh (``(dp, cp, tp)`` under ``--tp``) exist, with the framework's global seed set
    from ``config.seed``.

    Args:
        config: the run's options.
        platform: the platform whose process group the run uses.
        mesh: the ``(dp, cp)`` mesh, or ``(dp, cp, tp)`` when ``config.tp > 1``.
        reference: also build the no-CP copy (``--check-parity``, rank 0 only).

    Attributes:
        tokenizer: the ``--model`` directory's tokenizer, or None for the built-in byte model.
    """

    platforms: tuple[str, ...] = ()
    checkpoint_formats: tuple[str, ...] = ("whole",)  # what it saves; the first is the default
    shard_layout: str | None = None  # its sharded checkpoints' state/ (.checkpoint.SHARD_LAYOUTS)
    tensor_parallel: bool = False  # whether it trains with --tp above 1
    expert_parallel: bool = False  # whether it trains with --ep above 1 and the router's loss
    aux_share: float = 0.0  # the rank's share of the last step's weighted load-balancing loss
    tokenizer: Any = None

    @classmethod
    def check(cls, config: TrainConfig, platform_name: str) -> None:
        """Refuse options or a platform this backend cannot train with, on every rank before any
        process group exists (``NotImplementedError`` naming what is supported)."""
        if platform_name not in cls.platforms:
            raise NotImplementedError(
                f"{cls.__name__} trains on HP_PLATFORM={' / '.join(cls.platforms)}, not {platform_name}"
            )
        cls.check_tp_option(config, platform_name)
        cls.check_checkpoint_options(config, platform_name)

    @classmethod
    def check_tp_option(cls, config: TrainConfig, platform_name: str) -> None:
        """Refuse ``--tp`` above 1 where this backend has no tensor parallelism."""
        if config.tp > 1 and not cls.tensor_parallel:
            raise NotImplementedError(
                f"--tp {config.tp}: scripts/train.py trains with tensor parallelism on torch (HP_PLATFORM=cpu / "
                f"cuda / npu); HP_PLATFORM={platform_name} trains here with --tp 1 (a MindSpore model splits "
                "by heads in a loop of your own: hyperpar_gdn.tensor_parallel.mindspore_apply)"
            )
        if (config.ep > 1 or config.router_aux_loss_coef) and not cls.expert_parallel:
            raise NotImplementedError(
                "--ep and --router-aux-loss-coef (expert parallelism, the router's load-balancing loss) "
                "train on torch (HP_PLATFORM=cpu / cuda / npu): MindSpore's MoE cell runs every expert on every "
                f"token, with no token dispatch to split; HP_PLATFORM={platform_name} trains without them"
            )

    @classmethod
    def check_checkpoint_options(cls, config: TrainConfig, platform_name: str) -> None:
        """Refuse a ``--checkpoint-format`` (or ``--async-save``) this backend cannot write."""
        fmt = config.checkpoint_format or cls.checkpoint_formats[0]
        if fmt not in cls.checkpoint_formats:
            raise NotImplementedError(
                f"--checkpoint-format {fmt}: HP_PLATFORM={platform_name} writes "
                f"{' or '.join(cls.checkpoint_formats)} checkpoints"
            )
        if config.async_save and fmt != "sharded":
            raise NotImplementedError(
                f"--async-save writes sharded checkpoints in the background; HP_PLATFORM={platform_name} "
                f"with --checkpoint-format {fmt} saves whole checkpoints, synchronously"
            )

    @abstractmethod
    def __init__(self, config: TrainConfig, platform: Platform, mesh: DeviceMesh, *, reference: bool) -> None:
        """Build the model (context parallel over ``mesh["cp"]``), its optimizer and, with
        ``reference``, the no-CP copy with its own optimizer."""

    @abstractmethod
    def backward(self, shard: ContextParallelBatch, *, scale: float) -> tuple[float, float]:
        """Forward and backward on this rank's ``shard`` (host tensors): the gradients of ``scale x``
        the rank's context-parallel LM loss, synced over the mesh and clipped to ``--grad-clip``.
        Returns (the unscaled loss: this rank's term of its CP group's mean, the global gradient
        2-norm before clipping). The gradients wait for :meth:`apply_step` or :meth:`discard_step`."""

    @abstractmethod
    def apply_step(self, *, lr: float) -> None:
        """AdamW at learning rate ``lr`` with the gradients of the last :meth:`backward`; clears them."""

    @abstractmethod
    def discard_step(self) -> None:
        """Drop the gradients of the last :meth:`backward` (a skipped step: weights and optimizer
        state stay as they were)."""

    @abstractmethod
    def reference_step(self, whole: ContextParallelBatch, *, lr: float) -> float:
        """The same step on the no-CP copy over the ``whole`` global batch; returns its mean loss."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The ``model`` and ``optimizer`` parts of a checkpoint (``torch.save``-able; collective
        where parameters are sharded: every rank calls it, rank 0's are the ones written), in the
        single-device row order."""

    def row_orders(self) -> dict[str, Any]:
        """The tensors this backend's sharded checkpoints hold out of the single-device row order
        (:mod:`~hyperpar_gdn.train.checkpoints.row_orders`; none by default); its whole checkpoints and exports hold none."""
        return {}

    @abstractmethod
    def load_state_dict(self, path: str, parts: dict[str, Any]) -> None:
        """Load the ``model`` and ``optimizer`` parts read from checkpoint ``path`` into the model
        and the reference; a part this backend cannot read is a ``ValueError`` naming ``path``."""

    def save_shards(self, directory: Path, *, background: bool) -> Future | None:
        """Collective: every rank writes its shard of the model and optimizer state under
        ``directory/state`` (:mod:`~hyperpar_gdn.train.checkpoints.sharded`); refuses (``CheckpointError`` on every rank)
        a state that holds NaN or inf. ``background``: returns the future of the writes."""
        raise NotImplementedError(f"{type(self).__name__} writes whole checkpoints only")

    def load_shards(self, path: str, shards: str, *, layout: str) -> None:
        """Collective: load a sharded checkpoint's state (directory ``shards``, laid out as
        ``layout``) into the model in its current layout, and the reference; ``ValueError`` naming
        ``path`` where it cannot (the same on every rank, before any communication)."""
        raise ValueError(
            f"checkpoint {path} is sharded (format 2, layout {layout!r}); HP_PLATFORM={self.platform.name} "
            "resumes the whole checkpoints it writes"
        )

    @abstractmethod
    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over every rank (float64 where the device reduces it)."""

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` over every rank."""
        world = self.world_size
        slots = [0.0] * world
        slots[self.rank] = float(value)
        return int(max(self.sum_over_ranks(slots)))

    platform: Platform  # set by __init__

    @property
    def rank(self) -> int:
        return self.platform.rank()

    @property
    def world_size(self) -> int:
        return self.platform.world_size()

    @abstractmethod
    def peak_memory(self) -> tuple[int, str]:
        """(bytes, kind) of this process: "allocated" (an accelerator's allocator) or "rss"."""

    def silent_ranks(self, tag: str, *, wait_s: float) -> list[int] | None:
        """After a collective timed out: a roll call among the ranks that are still answering
        (each that calls this with the same ``tag`` answers); returns the ranks that did not answer
        within ``wait_s`` seconds, or None when the platform has no channel for it."""
        return None

    def synchronize(self) -> None:
        """Wait for the device's queued work (for step timing); nothing to wait for by default."""
        return None

    @abstractmethod
    def exporter(self, out: str) -> Callable[[], None]:
        """Gather what exporting the ``--model`` to ``out`` needs (collective: every rank calls
        it) and return the work that rank 0 then runs to write the directory."""

    @abstractmethod
    def num_parameters(self) -> int: ...

    @abstractmethod
    def model_config(self) -> dict[str, Any]:
        """The trained model's configuration, for the metrics file."""

    def vocab_size(self) -> int:
        """Rows of the model's embedding: token ids must be below it."""
        config = self.model_config()
        return int(config.get("vocab_size") or config["text_config"]["vocab_size"])
