"""Training options: one keyword-only dataclass (its command line: :mod:`.command_line`).

Checks that need only the options live in ``TrainConfig.__post_init__``; those that need the
world size (known once the process group is up) in :meth:`TrainConfig.mesh_shape`. Every error names
the command-line option to change.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.cli import option, ranks
from hyperpar_gdn.models.config import HybridLMConfig
from hyperpar_gdn.ops.gdn.kernels import KERNELS
from hyperpar_gdn.planning.plan import (
    HEAD_MODES,
    LAYOUTS,
    MODE_CHOICES,
    inner_size_option_error,
)
from hyperpar_gdn.train.model_sizes import MODEL_SIZES

CP_MODES = MODE_CHOICES
CHECKPOINT_FORMATS = ("sharded", "whole")
DTYPES = ("fp32", "bf16")
SAVE_ERROR_POLICIES = ("stop", "continue")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Every option of ``scripts/train.py``: a field's flag is its name with dashes (a bool field
    that defaults to True: ``--no-<name>``), its ``help`` what ``--help`` prints and what
    docs/training.md's option table says at more length (a test keeps the two alike).
    :mod:`.command_line` derives the parser from these fields."""

    cp_mode: str = option(
        "ulysses",
        choices=CP_MODES,
        help="CP mode of the GDN layers (softmax layers all-gather K and V); auto: the mode the cost "
        "model predicts fastest, named with its reason in the run header (see docs/modes.md)",
    )
    cp_layout: str | None = option(
        None,
        choices=LAYOUTS,
        help="tokens per CP rank: contiguous, or head_tail (pieces r and 2cp-1-r of 2cp: equal "
        "softmax-attention work on every rank; default: head_tail when the model has softmax-attention "
        "layers, else contiguous)",
    )
    cp_size: int | None = option(
        None,
        help="ranks per CP group (default: all ranks over --tp); the other ranks do data parallelism",
    )
    tp: int = option(
        1,
        help="tensor parallelism: ranks that split every decoder block by heads and columns (the "
        "innermost mesh axis: the world is dp x cp x tp); torch only",
    )
    ep: int = option(
        1,
        help="expert parallelism: ranks that split every MoE block's routed experts by expert, taken "
        "from the data-parallel x CP ranks (ep divides dp x cp); needs --model with a MoE model; torch only",
    )
    router_aux_loss_coef: float | None = option(
        None,
        help="weight of the MoE router's load-balancing loss, counted over the whole global batch "
        "(default: the model's router_aux_loss_coef when its config sets output_router_logits, else none)",
    )
    cp_inner_size: int | None = option(
        None,
        help="two-level --cp-mode ulysses+<state mode>: ranks per inner (ulysses) group, e.g. a node; "
        "it divides --cp-size and the GDN value heads (default: none, one level)",
    )
    gdn_kernel: str = option(
        "auto",
        choices=KERNELS,
        help="the GDN layers' local kernel under CP: auto (fla's Triton kernels on CUDA and Ascend where "
        "they import, else ours), fla or native; named with its reason in the run header",
    )
    steps: int = option(60, help="optimizer steps to reach (a resumed run continues up to this step)")
    seq_len: int = option(128, help="tokens per sequence (the whole sequence), before the CP split")
    batch_size: int = option(8, help="sequences per step, all DP replicas (the global batch)")
    model_size: str | None = option(
        None, choices=MODEL_SIZES, help="built-in model preset (default: tiny; not with --model)"
    )
    model_dir: str | None = option(
        None,
        flag="--model",
        help="a transformers Qwen3.5 model directory to train (default: the built-in model)",
    )
    export: str | None = option(
        None,
        help="with --model: rank 0 writes the trained model as a transformers directory there "
        "(default: none)",
    )
    lr: float = option(1e-3, help="peak AdamW learning rate (linear warmup to it, then constant)")
    warmup_steps: int = option(5, help="linear warmup steps")
    weight_decay: float = option(0.1, help="AdamW weight decay (on matrices only)")
    grad_clip: float = option(1.0, help="max global grad norm (0: off)")
    seed: int = option(0, help="model init and data order")
    data: str | None = option(
        None,
        help='text file, JSONL file ("text" per line) or a directory of them; byte tokens for the '
        "built-in model, the directory's tokenizer for --model (default: the built-in corpus)",
    )
    doc_boundaries: bool = option(
        True,
        help="train on plain windows of the concatenated documents (no restart at document starts; "
        "default: off, documents restart: the DP replica's rows are packed into one row whose documents "
        "restart the model's state, conv and attention, with no label across a boundary)",
    )
    metrics_json: str | None = option(
        None, help="JSON file for per-step losses, tokens/s, peak memory (rank 0; default: none)"
    )
    save: str | None = option(
        None,
        help="checkpoint root directory (step-N/ under it; default: no checkpoints); a root that holds "
        "a complete checkpoint resumes from its newest (see --no-auto-resume)",
    )
    save_every: int = option(0, help="save every N steps (0: at the end)")
    keep_last: int = option(0, help="keep the newest N checkpoints (0: all)")
    auto_resume: bool = option(
        True,
        help="start at step 1 even when --save DIR holds checkpoints (by default: resume from the newest)",
    )
    resume: str | None = option(
        None, help="a step-N checkpoint directory, or a root (its latest step-N; default: none)"
    )
    checkpoint_format: str | None = option(
        None,
        choices=CHECKPOINT_FORMATS,
        help="sharded: every rank writes its shard (torch's DCP; on MindSpore a part of its replicated "
        "state); whole: rank 0 writes the gathered state (default: sharded; both formats resume)",
    )
    async_save: bool = option(
        False,
        help="write sharded checkpoints in the background while training goes on (dcp.async_save on "
        "torch, a thread per rank on MindSpore); each is committed at the next save or at the end",
    )
    fsdp: bool = option(False, help="shard parameters, gradients, optimizer state over all ranks (FSDP2)")
    ac: bool = option(False, help="activation checkpointing: recompute each decoder layer in the backward")
    dtype: str = option(
        "fp32",
        choices=DTYPES,
        help="compute dtype: bf16 (GPU/NPU) multiplies in bf16 with fp32 master weights, optimizer "
        "state, GDN state maths and loss (checkpoints stay fp32); fp32 on CPUs",
    )
    check_parity: bool = option(
        False, help="rank 0 also trains a no-CP copy on the whole global batch and compares every step's loss"
    )
    parity_tol: float = option(1e-4, help="max per-step loss difference for --check-parity")
    log_every: int = option(1, help="print a step line every N steps (and at the last step)")
    timeout_s: float = option(
        600.0,
        help="process-group timeout (seconds): a collective that waits longer (a rank that stopped "
        "answering) ends the run on the ranks that wait, naming the step",
    )
    max_bad_steps: int = option(
        3, help="stop after N steps in a row whose loss or gradient norm is not finite (each is skipped)"
    )
    on_save_error: str = option(
        "stop",
        choices=SAVE_ERROR_POLICIES,
        help="a checkpoint or export that cannot be written: stop the run, or continue without it",
    )
    plan: bool = option(
        False,
        help="print the memory plan (estimate per rank, budget, longest --seq-len that fits) and exit",
    )
    max_memory_gb: float | None = option(
        None,
        help="memory per rank in GiB; a run estimated above it is refused (default: the device's memory, "
        "on the CPU the host's available memory over the local ranks)",
    )

    def __post_init__(self) -> None:
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"--cp-mode {self.cp_mode!r} is not a mode; choose one of {', '.join(CP_MODES)}")
        inner_error = inner_size_option_error(self.cp_mode, self.cp_inner_size)
        if inner_error is not None:
            raise ValueError(inner_error)
        if self.gdn_kernel not in KERNELS:
            raise ValueError(
                f"--gdn-kernel {self.gdn_kernel!r} is not a kernel; choose one of {', '.join(KERNELS)}"
            )
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
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1; got {self.tp}")
        if self.ep < 1:
            raise ValueError(f"--ep must be >= 1; got {self.ep}")
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ValueError(f"--router-aux-loss-coef must be >= 0; got {self.router_aux_loss_coef}")
        for flag, value, unset in (
            ("--ep", self.ep, 1),
            ("--router-aux-loss-coef", self.router_aux_loss_coef, None),
        ):
            if value != unset and self.model_dir is None:
                raise ValueError(
                    f"{flag} {value} acts on a MoE model's experts and router; the built-in model has none: "
                    "pass --model DIR of a Qwen3.5 MoE model"
                )
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

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp, cp, tp): the shape of the data-parallel x context-parallel x tensor-parallel mesh of
        ``world_size`` ranks (tp innermost); checks the options that depend on the world size (the
        model's heads against ``--tp`` are the tensor-parallel plan's check, when the model is built)."""
        tp = self.tp
        if world_size % tp:
            raise ValueError(
                f"{ranks(world_size)} (torchrun --nproc-per-node x --nnodes) cannot be split into TP groups "
                f"of --tp {tp}: --tp must divide {world_size}"
            )
        cp = world_size // tp if self.cp_size is None else self.cp_size
        if world_size % (cp * tp):
            rule = f"--cp-size must divide {world_size}"
            if tp > 1:
                rule = f"--cp-size x --tp = {cp} x {tp} must divide {world_size}"
            raise ValueError(
                f"{ranks(world_size)} (torchrun --nproc-per-node x --nnodes, or msrun --worker_num) cannot "
                f"be split into CP groups of --cp-size {cp}: {rule}"
            )
        dp = world_size // (cp * tp)
        if (dp * cp) % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide the data-parallel x CP ranks dp x cp = {dp} x {cp} "
                f"({ranks(world_size)}{f' / --tp {tp}' if tp > 1 else ''}): expert parallelism spans ranks "
                "that hold different tokens"
            )
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
                f"({ranks(world_size)} / --cp-size {cp}{f' / --tp {tp}' if tp > 1 else ''})"
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
        if cp > 1 and self.cp_mode in HEAD_MODES and num_v_heads % (cp * tp):
            if tp > 1:
                raise ValueError(
                    f"--cp-mode {self.cp_mode} splits each TP rank's GDN value heads over cp={cp}, but "
                    f"{self.model_name} has {num_v_heads} value heads, not divisible by tp x cp = {tp} x {cp}; "
                    "use --cp-mode p2p, all_gather, scan or auto, or a smaller --cp-size or --tp"
                )
            raise ValueError(
                f"--cp-mode {self.cp_mode} splits the GDN value heads over cp={cp}, but {self.model_name} has "
                f"{num_k_heads} key and {num_v_heads} value heads; "
                "use --cp-mode p2p, all_gather, scan or auto, or a smaller --cp-size"
            )
        return dp, cp, tp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")
