"""Training options: one keyword-only dataclass (its command line: :mod:`.command_line`).

Checks that need only the options live in ``TrainConfig.__post_init__``; those that need the
world size (known once the process group is up) in :meth:`TrainConfig.layout`. Every error names
the command-line option to change.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.cp.two_level import TWO_LEVEL_MODES
from hyperpar_gdn.distributed.cp.ulysses import HEAD_MODES
from hyperpar_gdn.distributed.layout import LAYOUTS
from hyperpar_gdn.distributed.linear_attention_style import MODES
from hyperpar_gdn.models.config import HybridLMConfig
from hyperpar_gdn.train.model_sizes import MODEL_SIZES

CP_MODES = (*MODES, *TWO_LEVEL_MODES, "auto")
CHECKPOINT_FORMATS = ("sharded", "whole")
DTYPES = ("fp32", "bf16")
SAVE_ERROR_POLICIES = ("stop", "continue")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Every option of ``scripts/train.py`` (its flag is the field name with dashes).

    Attributes:
        cp_mode: context-parallel mode of the GDN layers (softmax layers all-gather K and V);
            "auto": the mode the cost model predicts fastest (the run header says which and why).
        cp_layout: which tokens a CP rank holds: "contiguous" or "head_tail" (pieces r and
            2cp-1-r of 2*cp: equal softmax-attention work on every rank). None: head_tail when
            the model has softmax-attention layers, else contiguous (:meth:`token_layout`).
        cp_size: ranks per CP group; the world is split into world/cp_size data-parallel
            replicas. None: every rank in one CP group.
        cp_inner_size: for the two-level modes ("ulysses+p2p", "ulysses+all_gather",
            "ulysses+scan") only: ranks per inner group (ulysses inside it, the state mode
            across); the CP group must be the whole world and the layout contiguous.
        steps: optimizer steps to reach (a resumed run continues up to this step).
        seq_len: tokens per sequence (the whole sequence, before the CP split).
        batch_size: sequences per step over all DP replicas (the global batch).
        model_size: a key of :data:`MODEL_SIZES` for the built-in model (None: "tiny").
        model_dir: a transformers Qwen3.5 model directory to train instead (``--model``).
        export: where rank 0 writes the trained ``--model`` as a transformers directory.
        lr, warmup_steps, weight_decay, grad_clip: AdamW with linear warmup to ``lr`` then
            constant; decay on matrices only; clip the global gradient norm (0: off).
        seed: model init and data order.
        data: a text file, a JSONL file ("text" field per line) or a directory of them; byte
            tokens for the built-in model, the directory's tokenizer for ``--model``; None: the
            built-in corpus.
        doc_boundaries: where a document starts inside a sequence, pack the DP replica's rows
            into one row whose documents restart the model's state, conv and attention, and
            learn no label across a boundary; False: plain windows of the concatenated stream.
        metrics_json: where rank 0 writes the per-step losses, tokens/s and peak memory.
        save: checkpoint root; ``step-N/`` directories go under it. A run started with a root
            that holds a complete checkpoint resumes from its newest (see ``auto_resume``).
        save_every: also save every this many steps (0: only at the last step).
        keep_last: after each save keep only the newest this many checkpoints (0: keep all).
        auto_resume: with ``save``, resume from the newest complete checkpoint under it when one
            exists (a restarted run continues); False (``--no-auto-resume``): always start at step 1.
        resume: a ``step-N`` directory, or a root whose latest ``step-N`` is taken.
        checkpoint_format: "sharded" (every rank writes its shard: torch's DCP, MindSpore's parts
            of its replicated state) or "whole" (the state gathered and written by rank 0). None:
            the backend's default (sharded). Either format resumes, whatever this option says.
        async_save: write the sharded checkpoints in the background (``dcp.async_save`` on
            torch, a thread per rank on MindSpore): training goes on while the shards are written;
            each is committed at the next save or at the end.
        fsdp: shard parameters, gradients and optimizer state over all ranks (FSDP2).
        ac: activation checkpointing: recompute each decoder layer in the backward.
        dtype: compute dtype, "fp32" or "bf16" (bf16 matmuls with fp32 master weights, optimizer
            state, GDN state maths and loss; checkpoints stay fp32). bf16 is the choice on GPUs and
            NPUs; fp32 on CPUs.
        check_parity: rank 0 also trains a no-CP copy on the whole global batch and compares.
        parity_tol: the largest allowed per-step loss difference under ``check_parity``.
        log_every: print a step line every this many steps (and at the last step).
        timeout_s: process-group timeout: a collective that waits longer (a rank that stopped
            answering) ends the run on the ranks that wait, naming the step.
        max_bad_steps: stop after this many steps in a row whose loss or gradient norm is not
            finite (each is skipped: no update, never saved).
        on_save_error: a checkpoint or export that cannot be written (a full or read-only disk):
            "stop" the run (every rank, one line) or "continue" without it.
        plan: print the memory plan (:mod:`.memory_check`: the estimate per rank, the budget, the
            longest sequence that fits) and exit without building anything.
        max_memory_gb: the memory one rank may use (GiB); None: the device's memory, or on the CPU
            the host's available memory over the local ranks. A run estimated above it is refused.
    """

    cp_mode: str = "ulysses"
    cp_layout: str | None = None
    cp_size: int | None = None
    cp_inner_size: int | None = None
    steps: int = 60
    seq_len: int = 128
    batch_size: int = 8
    model_size: str | None = None
    model_dir: str | None = None
    export: str | None = None
    lr: float = 1e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    data: str | None = None
    doc_boundaries: bool = True
    metrics_json: str | None = None
    save: str | None = None
    save_every: int = 0
    keep_last: int = 0
    auto_resume: bool = True
    resume: str | None = None
    checkpoint_format: str | None = None
    async_save: bool = False
    fsdp: bool = False
    ac: bool = False
    dtype: str = "fp32"
    check_parity: bool = False
    parity_tol: float = 1e-4
    log_every: int = 1
    timeout_s: float = 600.0
    max_bad_steps: int = 3
    on_save_error: str = "stop"
    plan: bool = False
    max_memory_gb: float | None = None

    def __post_init__(self) -> None:
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"--cp-mode {self.cp_mode!r} is not a mode; choose one of {', '.join(CP_MODES)}")
        if (self.cp_mode in TWO_LEVEL_MODES) != (self.cp_inner_size is not None):
            raise ValueError(
                f"--cp-inner-size goes with the two-level modes ({', '.join(TWO_LEVEL_MODES)}) and only then; "
                f"got --cp-mode {self.cp_mode} and --cp-inner-size {self.cp_inner_size}"
            )
        if self.cp_inner_size is not None and self.cp_layout != "contiguous":
            raise ValueError(f"--cp-mode {self.cp_mode} needs --cp-layout contiguous; got {self.cp_layout}")
        if self.cp_layout is not None and self.cp_layout not in LAYOUTS:
            raise ValueError(
                f"--cp-layout {self.cp_layout!r} is not a token layout; choose one of {', '.join(LAYOUTS)}"
            )
        if self.model_size is not None and self.model_size not in MODEL_SIZES:
            raise ValueError(
                f"--model-size {self.model_size!r} is unknown; choose one of {', '.join(MODEL_SIZES)}"
            )
        for name in ("steps", "seq_len", "batch_size", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1; got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "keep_last", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0; got {getattr(self, name)}")
        for name in ("lr", "parity_tol", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0; got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0; got {getattr(self, name)}")
        if self.cp_size is not None:
            if self.cp_size < 1:
                raise ValueError(f"--cp-size must be >= 1; got {self.cp_size}")
        if self.on_save_error not in SAVE_ERROR_POLICIES:
            raise ValueError(f"--on-save-error {self.on_save_error!r} is not one of stop, continue")
        if self.max_memory_gb is not None and not self.max_memory_gb > 0:
            raise ValueError(f"--max-memory-gb must be > 0; got {self.max_memory_gb}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.model_dir is not None and self.model_size is not None:
            raise ValueError(
                f"--model-size {self.model_size} sizes the built-in model; --model {self.model_dir} brings its own"
            )
        if self.export is not None and self.model_dir is None:
            raise ValueError(f"--export {self.export} writes a transformers directory; it needs --model DIR")
        if self.save_every and self.save is None:
            raise ValueError(f"--save-every {self.save_every} needs --save DIR (where to write checkpoints)")
        if self.checkpoint_format is not None and self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"--checkpoint-format {self.checkpoint_format!r} is not one of {', '.join(CHECKPOINT_FORMATS)}"
            )
        if self.async_save and self.save is None:
            raise ValueError("--async-save needs --save DIR (where to write checkpoints)")
        if self.async_save and self.checkpoint_format == "whole":
            raise ValueError(
                "--async-save writes sharded checkpoints; --checkpoint-format whole is written by rank 0"
            )
        if self.keep_last and self.save is None:
            raise ValueError(f"--keep-last {self.keep_last} needs --save DIR (whose checkpoints to prune)")

    @property
    def model(self) -> HybridLMConfig:
        """The built-in model's sizes (without ``--model``)."""
        return MODEL_SIZES[self.model_size or "tiny"]

    @property
    def model_name(self) -> str:
        return self.model_dir if self.model_dir is not None else f"--model-size {self.model_size or 'tiny'}"

    def gdn_dims(self) -> tuple[int, int, int]:
        """(key heads, value heads, conv width) of the GDN layers of the model to train (``--model``'s
        config.json is read on the first call only)."""
        return self._gdn_dims

    def token_layout(self) -> str:
        """``--cp-layout``, or its default: head_tail when the model has softmax-attention layers
        (their causal work is then the same on every rank), else contiguous. ``--model``'s
        config.json is read on the first call only."""
        if self.cp_layout is not None:
            return self.cp_layout
        return "head_tail" if self._has_softmax_attention else "contiguous"

    # Facts of the model read once: cached properties of the frozen options.
    @functools.cached_property
    def _gdn_dims(self) -> tuple[int, int, int]:
        if self.model_dir is not None:
            from hyperpar_gdn.integrations.transformers.model_config import gdn_dims

            return gdn_dims(self.model_dir)
        m = self.model
        return m.linear_num_key_heads, m.linear_num_value_heads, m.linear_conv_kernel_dim

    @functools.cached_property
    def _has_softmax_attention(self) -> bool:
        if self.model_dir is not None:
            from hyperpar_gdn.integrations.transformers.model_config import has_softmax_attention

            return has_softmax_attention(self.model_dir)
        return "full_attention" in self.model.layer_types

    def layout(self, world_size: int) -> tuple[int, int]:
        """(dp, cp) for ``world_size`` ranks; checks the options that depend on it."""
        cp = world_size if self.cp_size is None else self.cp_size
        if world_size % cp:
            raise ValueError(
                f"{world_size} ranks (torchrun --nproc-per-node x --nnodes, or msrun --worker_num) cannot "
                f"be split into CP groups of --cp-size {cp}: --cp-size must divide {world_size}"
            )
        dp = world_size // cp
        inner = self.cp_inner_size
        if inner is not None and (cp % inner or self.gdn_dims()[1] % inner):
            raise ValueError(
                f"--cp-mode {self.cp_mode}: --cp-inner-size {inner} must divide cp={cp} and the "
                f"{self.gdn_dims()[1]} GDN value heads"
            )
        if self.seq_len % cp:
            raise ValueError(f"--seq-len {self.seq_len} must be divisible by the CP size {cp} (--cp-size)")
        if self.batch_size % dp:
            raise ValueError(
                f"--batch-size {self.batch_size} must be divisible by the {dp} data-parallel replicas "
                f"({world_size} ranks / --cp-size {cp})"
            )
        num_k_heads, num_v_heads, conv_width = self.gdn_dims()
        pieces = 2 * cp if cp > 1 and self.token_layout() == "head_tail" else cp
        if self.seq_len % pieces:
            raise ValueError(
                f"--cp-layout head_tail cuts --seq-len {self.seq_len} into 2 x cp = {pieces} equal pieces; "
                "use a --seq-len divisible by it, or --cp-layout contiguous"
            )
        local = self.seq_len // pieces
        halo = conv_width - 1
        if cp > 1 and self.cp_mode not in HEAD_MODES and inner is None and local < halo:
            raise ValueError(
                f"--cp-mode {self.cp_mode}: --seq-len {self.seq_len} / {pieces} = {local} tokens per piece "
                f"(cp {cp}, --cp-layout {self.token_layout()}), fewer than the conv halo {halo}; use a longer "
                "--seq-len or a smaller --cp-size"
            )
        if cp > 1 and self.cp_mode in HEAD_MODES and num_v_heads % cp:
            raise ValueError(
                f"--cp-mode {self.cp_mode} splits the GDN value heads over cp={cp}, but {self.model_name} has "
                f"{num_k_heads} key and {num_v_heads} value heads; "
                "use --cp-mode p2p, all_gather, scan or auto, or a smaller --cp-size"
            )
        return dp, cp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")
