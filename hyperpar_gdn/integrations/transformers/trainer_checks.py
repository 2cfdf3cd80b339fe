"""The set-up checks of :class:`~hyperpar_gdn.integrations.transformers.trainer.ContextParallelTrainer`.

Every check here reads only the model, the ``TrainingArguments`` and the launch environment, so a
wrong set-up raises the same one-line error on every rank before the Trainer (or anything of ours)
joins a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.decoder_layers import find_decoder, mixers_of
from hyperpar_gdn.distributed.layout import check_layout
from hyperpar_gdn.distributed.plan import CPPlan, check_mode, plan_errors
from hyperpar_gdn.ops.gdn.layer import LayerDims

__all__ = ["CPSetup", "check_trainer_setup"]

# (TrainingArguments field, the value the CP path needs, why)
_REQUIRED_ARGS = (
    ("torch_compile", False, "torch.compile does not trace the context-parallel collectives"),
    ("deepspeed", None, "DeepSpeed's engine replaces the gradient path CP relies on"),
    ("label_smoothing_factor", 0.0, "the CP loss is plain cross-entropy"),
    ("average_tokens_across_devices", True, "the CP loss divides by the labelled tokens of the global batch"),
    ("include_num_input_tokens_seen", "no", "its count would include every CP rank's copy of the batch"),
    ("use_liger_kernel", False, "Liger patches the model's loss and layers"),
    ("loss_type", "nll", "the CP loss is cross-entropy (TRL's loss_type='nll')"),
    (
        "train_sampling_strategy",
        ("random", "sequential", "group_by_length"),
        "batch_rebalance shards over every rank",
    ),
)


@dataclass(frozen=True)
class CPSetup:
    """What the checks decided: the mesh shape and the CP options.

    Attributes:
        world: processes launched.
        dp: data-parallel replicas (``world / cp``).
        cp: ranks per context-parallel group.
        mode: the GDN layers' CP mode as asked (``"auto"`` included).
        layout: the token layout of every shard.
        chunk_size: chunk of the gated delta rule.
        plan: the :class:`~hyperpar_gdn.CPPlan`, or None for ``"auto"`` (chosen when the model is
            parallelized, by the cost model at ``seq_len`` tokens).
        seq_len: the sequence length ``"auto"`` prices (None for the other modes).
    """

    world: int
    dp: int
    cp: int
    mode: str
    layout: str
    chunk_size: int
    plan: CPPlan | None = None
    seq_len: int | None = None


def check_trainer_setup(
    model: Any,
    args: Any,
    *,
    world: int,
    cp_size: int,
    cp_mode: str,
    cp_layout: str | None,
    cp_chunk_size: int,
    cp_inner_size: int | None = None,
    cp_seq_len: int | None = None,
) -> CPSetup:
    """Check a Trainer's set-up for context parallelism; no communication.

    Args:
        model: the model given to the Trainer (a transformers Qwen3.5 causal LM).
        args: its ``TrainingArguments`` (or TRL's config), or None for the defaults.
        world: processes launched (torchrun's ``WORLD_SIZE``).
        cp_size: ranks per CP group; must divide ``world``.
        cp_mode: one of :data:`~hyperpar_gdn.distributed.plan.MODE_CHOICES` (a one-level mode, a
            two-level mode with ``cp_inner_size``, or ``"auto"``).
        cp_layout: ``"contiguous"``, ``"head_tail"`` or None (head_tail when the model has
            softmax-attention layers and the mode serves it, else contiguous).
        cp_chunk_size: chunk of the gated delta rule.
        cp_inner_size: ranks per inner group (a node) of the two-level modes.
        cp_seq_len: the tokens per sequence that ``cp_mode="auto"`` prices (else ``args.max_length``).

    Returns the :class:`CPSetup`; raises ``ValueError`` / ``TypeError`` / ``NotImplementedError``
    naming the value and the rule.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive int")
    if world % cp_size:
        raise ValueError(
            f"cp_size={cp_size} does not divide the {world} launched processes (WORLD_SIZE={world}); "
            f"launch a multiple of {cp_size} processes or choose a cp_size that divides {world}"
        )
    try:
        check_mode(cp_mode, allow_auto=True)
    except ValueError as error:
        raise ValueError(str(error).replace("mode=", "cp_mode=", 1)) from None
    if cp_layout is not None:
        check_layout(cp_layout)
    if isinstance(cp_chunk_size, bool) or not isinstance(cp_chunk_size, int) or cp_chunk_size < 1:
        raise ValueError(f"cp_chunk_size={cp_chunk_size!r} must be a positive int")
    if args is not None:
        _check_args(args)
    seq_len = None
    if cp_mode == "auto":
        seq_len = cp_seq_len if cp_seq_len is not None else getattr(args, "max_length", None)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(
                f"cp_mode='auto' chooses a mode for a sequence length: pass cp_seq_len= (tokens per "
                f"sequence) or set args.max_length; got cp_seq_len={cp_seq_len!r}"
            )
    elif cp_seq_len is not None:
        raise ValueError(f"cp_seq_len is for cp_mode='auto' only; got cp_mode={cp_mode!r}")
    kinds = _check_model(model)
    two_level = cp_inner_size is not None or "+" in cp_mode
    layout = cp_layout or ("head_tail" if "self_attn" in kinds and not two_level else "contiguous")
    plan = None
    if cp_mode != "auto":
        plan = CPPlan(mode=cp_mode, layout=layout, inner_size=cp_inner_size, chunk_size=cp_chunk_size)
        _, text_model = find_decoder(model)
        gdn = [
            (i, LayerDims.of(m)) for i, (kind, m) in enumerate(mixers_of(text_model)) if kind == "linear_attn"
        ]
        errors = plan_errors(plan, gdn, cp=cp_size, ranks=range(cp_size), world=world)
        if errors:
            raise errors[0]
    elif cp_inner_size is not None:
        raise ValueError(
            f"cp_inner_size={cp_inner_size} with cp_mode='auto': auto ranks the two-level modes by "
            "the mesh itself; give a two-level cp_mode to fix the inner size"
        )
    return CPSetup(
        world=world,
        dp=world // cp_size,
        cp=cp_size,
        mode=cp_mode,
        layout=layout,
        chunk_size=cp_chunk_size,
        plan=plan,
        seq_len=seq_len,
    )


def _check_model(model: Any) -> set[str]:
    """The mixer kinds of ``model``; errors for what CP cannot train."""
    if isinstance(model, str) or model is None:
        raise TypeError(
            f"model={model!r}: context parallelism needs the loaded model object (e.g. "
            "AutoModelForCausalLM.from_pretrained(...)), not a name or None"
        )
    name = type(model).__name__
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise ValueError(
            f"{name} has no LM head: context-parallel training needs a causal LM such as Qwen3_5ForCausalLM"
        )
    _, text_model = find_decoder(model)  # ValueError naming the supported models
    mixers = mixers_of(text_model)
    kinds = {kind for kind, _ in mixers}
    if "linear_attn" not in kinds:
        raise ValueError(
            f"{name} has no Gated DeltaNet (linear_attention) layers: this context parallelism is for GDN "
            "models; train a softmax-only model with accelerate's ParallelismConfig(cp_size=...) instead"
        )
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise NotImplementedError(
            f"{name}.config.output_router_logits=True: the router's auxiliary loss is not part of the CP loss; "
            "set it to False"
        )
    return kinds


def _check_args(args: Any) -> None:
    """Refuse TrainingArguments the CP path does not serve (the first one found)."""
    for field, needed, why in _REQUIRED_ARGS:
        value = getattr(args, field, needed)
        allowed = needed if isinstance(needed, tuple) else (needed,)
        value = getattr(value, "value", value)  # enums
        if value not in allowed and not (field == "deepspeed" and not value):
            raise NotImplementedError(
                f"TrainingArguments {field}={value!r} is not supported under context parallelism "
                f"({why}); set {field}={needed[0] if isinstance(needed, tuple) else needed!r}"
            )
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        sizes = {name: getattr(config, name, 1) or 1 for name in ("cp_size", "sp_size", "tp_size")}
        busy = {name: size for name, size in sizes.items() if size > 1}
        if "cp_size" in busy:
            raise NotImplementedError(
                f"ParallelismConfig(cp_size={busy['cp_size']}) is accelerate's context parallelism, which "
                "shards the batch for SDPA only and leaves the GDN layers wrong; remove it from "
                "TrainingArguments and pass cp_size to the trainer instead"
            )
        if busy:
            raise NotImplementedError(
                f"ParallelismConfig({', '.join(f'{k}={v}' for k, v in busy.items())}) is not supported with "
                "context parallelism; only data parallelism (DDP or FSDP over the processes) combines with it"
            )
