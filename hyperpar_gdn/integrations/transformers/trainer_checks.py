"""The set-up checks of :class:`~hyperpar_gdn.integrations.transformers.trainer.ContextParallelTrainer`.

Every check here reads only the model, the ``TrainingArguments`` and the launch environment, so a
wrong set-up raises the same one-line error on every rank before the Trainer (or anything of ours)
joins a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.decoder_layers import find_decoder, mixers_of
from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.ops.projections import wrapper_of
from hyperpar_gdn.planning.plan import CPPlan, check_layout, check_mode, plan_errors

__all__ = ["CPSetup", "check_head", "check_trainer_setup"]

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
        dp: data-parallel replicas (``world / (cp * tp)``).
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
    tp: int = 1  # tensor-parallel ranks (the innermost axis of the (dp, cp, tp) mesh)
    ep: int = 1  # expert-parallel ranks, taken from the dp x cp ranks of each TP index
    router_coef: float = 0.0  # the load-balancing loss's weight (the model's, under output_router_logits)


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
    tp_size: int = 1,
    gdn_kernel: str = "auto",
    ep_size: int = 1,
) -> CPSetup:
    """Check a Trainer's set-up for context parallelism; no communication.

    Args:
        model: the model given to the Trainer (a transformers Qwen3.5 causal LM).
        args: its ``TrainingArguments`` (or TRL's config), or None for the defaults.
        world: processes launched (torchrun's ``WORLD_SIZE``).
        cp_size: ranks per CP group; must divide ``world``.
        cp_mode: one of :data:`~hyperpar_gdn.planning.plan.MODE_CHOICES` (a one-level mode, a
            two-level mode with ``cp_inner_size``, or ``"auto"``).
        cp_layout: ``"contiguous"``, ``"head_tail"`` or None (head_tail when the model has
            softmax-attention layers and the mode serves it, else contiguous).
        cp_chunk_size: chunk of the gated delta rule.
        cp_inner_size: ranks per inner group (a node) of the two-level modes.
        cp_seq_len: the tokens per sequence that ``cp_mode="auto"`` prices (else ``args.max_length``).
        tp_size: tensor-parallel ranks (heads and columns split, :mod:`hyperpar_gdn.tensor_parallel`);
            ``cp_size * tp_size`` must divide ``world``.
        gdn_kernel: the GDN layers' local kernel, the plan's ``kernel``.
        ep_size: expert-parallel ranks (:mod:`hyperpar_gdn.expert_parallel`), taken from the
            data-parallel x CP ranks: it must divide ``world / tp_size``.

    Returns the :class:`CPSetup`; raises ``ValueError`` / ``TypeError`` / ``NotImplementedError``
    naming the value and the rule.
    """
    for name, size in (("cp_size", cp_size), ("tp_size", tp_size), ("ep_size", ep_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive int")
    if world % cp_size:
        raise ValueError(
            f"cp_size={cp_size} does not divide the {world} launched processes (WORLD_SIZE={world}); "
            f"launch a multiple of {cp_size} processes or choose a cp_size that divides {world}"
        )
    if world % (cp_size * tp_size):
        raise ValueError(
            f"cp_size={cp_size} x tp_size={tp_size} = {cp_size * tp_size} does not divide the {world} launched "
            f"processes (WORLD_SIZE={world}): the mesh is (dp, cp, tp); launch a multiple of {cp_size * tp_size}"
        )
    if ep_size > 1 and (world // tp_size) % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the {world // tp_size} data-parallel x CP ranks "
            f"(WORLD_SIZE={world} / tp_size={tp_size}): expert parallelism spans ranks that hold different tokens"
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
        if tp_size > 1 or ep_size > 1:
            _check_tp_args(args, tp_size, ep_size)
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
    router_coef = _router_coefficient(model)
    if ep_size > 1:
        from hyperpar_gdn.expert_parallel.style import expert_parallel_errors

        errors = expert_parallel_errors(model, ep_size)
        if errors:
            raise ValueError(f"ep_size={ep_size}: " + "; ".join(errors))
    if tp_size > 1:
        from hyperpar_gdn.tensor_parallel import tensor_parallel_plan

        # ValueError naming the layer; no change (expert-parallel MoE blocks stay whole over tp)
        tensor_parallel_plan(find_decoder(model)[1], tp_size, moe_expert_parallel=ep_size > 1)
    two_level = cp_inner_size is not None or "+" in cp_mode
    layout = cp_layout or ("head_tail" if "self_attn" in kinds and not two_level else "contiguous")
    plan = None
    if cp_mode != "auto":
        plan = CPPlan(
            mode=cp_mode, layout=layout, inner_size=cp_inner_size, chunk_size=cp_chunk_size, kernel=gdn_kernel
        )
        _, text_model = find_decoder(model)
        gdn = [
            (i, LayerDims.of(m).tp_rank(tp_size))
            for i, (kind, m) in enumerate(mixers_of(text_model))
            if kind == "linear_attn"
        ]  # the CP ranks of a TP rank: tp apart
        errors = plan_errors(plan, gdn, cp=cp_size, ranks=range(0, cp_size * tp_size, tp_size), world=world)
        if errors:
            raise errors[0]
    elif cp_inner_size is not None:
        raise ValueError(
            f"cp_inner_size={cp_inner_size} with cp_mode='auto': auto ranks the two-level modes by "
            "the mesh itself; give a two-level cp_mode to fix the inner size"
        )
    return CPSetup(
        world=world,
        dp=world // (cp_size * tp_size),
        cp=cp_size,
        tp=tp_size,
        ep=ep_size,
        router_coef=router_coef,
        mode=cp_mode,
        layout=layout,
        chunk_size=cp_chunk_size,
        plan=plan,
        seq_len=seq_len,
    )


def check_head(model: Any) -> None:
    """Refuse a wrapped LM head (PEFT's LoRA on ``lm_head``): the CP loss computes the logits from
    the head's weight in chunks (no rank holds its ``[B, T/cp, V]`` logits), which would bypass it."""
    head = model.get_output_embeddings()
    wrapper = wrapper_of(head)
    if wrapper is not None:
        raise NotImplementedError(
            f"the LM head is wrapped by {wrapper}: the context-parallel loss computes the logits from the "
            "head's weight, which would bypass the wrapper; leave lm_head out of the adapter's target modules"
        )


def _check_tp_args(args: Any, tp: int, ep: int = 1) -> None:
    """Refuse what the tensor- or expert-parallel Trainer does not serve (one line naming the value)."""
    option = f"tp_size={tp}" if tp > 1 else f"ep_size={ep}"
    refused = (
        ("fp16", bool(getattr(args, "fp16", False)), "use bf16=True or fp32"),
        (
            "fsdp",
            bool(getattr(args, "fsdp", None)),
            f"{option.split('=')[0]} replaces DDP by its own gradient average; FSDP is not wired",
        ),
        (
            "save_only_model",
            bool(getattr(args, "save_only_model", False))
            and bool(getattr(args, "load_best_model_at_end", False)),
            "load_best_model_at_end reads every rank's shards from the best checkpoint, which "
            "save_only_model leaves out",
        ),
    )
    for field, given, what in refused:
        if given:
            raise NotImplementedError(
                f"TrainingArguments {field}={getattr(args, field)!r} is not supported with {option}: {what}"
            )


def _router_coefficient(model: Any) -> float:
    """The load-balancing loss's weight: the model's ``router_aux_loss_coef`` when its config sets
    ``output_router_logits``, else 0 (the trainer computes that loss over the global batch)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0))


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
    return kinds


def _check_args(args: Any) -> None:
    """Refuse TrainingArguments the CP path does not serve (the first one found)."""
    for field, needed, why in _REQUIRED_ARGS:
        allowed = needed if isinstance(needed, tuple) else (needed,)
        value = getattr(args, field, allowed[0])  # absent (another Trainer's arguments): fine
        value = getattr(value, "value", value)  # enums
        if value not in allowed and not (field == "deepspeed" and not value):
            raise NotImplementedError(
                f"TrainingArguments {field}={value!r} is not supported under context parallelism "
                f"({why}); set {field}={needed[0] if isinstance(needed, tuple) else needed!r}"
            )
    fsdp_config = getattr(args, "fsdp_config", None)
    fsdp_config = fsdp_config if isinstance(fsdp_config, dict) else {}
    version = fsdp_config.get("fsdp_version", fsdp_config.get("version"))
    if getattr(args, "fsdp", None) and str(version) == "2":
        raise NotImplementedError(
            f"TrainingArguments fsdp={args.fsdp!r} with fsdp_version=2 is not supported under context "
            "parallelism (accelerate's FSDP2 beside the CP loss is untested, and on the CPU accelerate runs "
            "DDP in its place); leave fsdp unset (DDP over the processes) or train with scripts/train.py --fsdp"
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
                + ("; pass tp_size to the trainer for tensor parallelism" if "tp_size" in busy else "")
            )
