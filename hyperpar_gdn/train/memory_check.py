"""The memory plan of a ``scripts/train.py`` run: ``--plan``'s table, and the refusal of a run whose
estimate exceeds the budget (on every rank, before the process group or the model exists).

The arithmetic is :mod:`hyperpar_gdn.planning.memory`'s; here the options become its inputs (the model's sizes
from the built-in preset or ``--model``'s config.json, the ranks from the launcher's environment)
and the budget is ``--max-memory-gb``, else the platform's (:func:`rank_budget`: the device's
memory, or on the CPU the host's available memory over the local ranks plus what this process
already holds). The plan counts torch's autograd: the MindSpore trainer has none, and refuses
``--plan`` and ``--max-memory-gb``.
"""

from __future__ import annotations

import os

from hyperpar_gdn.cli import ranks as count_ranks
from hyperpar_gdn.ops.attention.softmax import attention_path
from hyperpar_gdn.planning.memory import (
    GIB,
    RUNTIME_BYTES,
    TERMS,
    Estimate,
    ModelShape,
    StepOptions,
    cheaper_options,
    estimate,
    largest_rank,
    longest_seq_len,
)
from hyperpar_gdn.planning.rank_shape import tp_split_error
from hyperpar_gdn.platform.memory_budget import local_ranks, rank_budget
from hyperpar_gdn.train.config import TrainConfig

__all__ = ["MemoryBudgetError", "check_memory", "plan_lines"]


class MemoryBudgetError(Exception):
    """A run whose estimated peak exceeds the budget; raised on every rank before anything is built."""


def launched_world_size(config: TrainConfig) -> int:
    """The launcher's world size (torchrun ``WORLD_SIZE``, msrun ``MS_WORKER_NUM``); without a
    launcher, the planned CP group (``--cp-size``, else 1) times ``--tp``."""
    value = os.environ.get("WORLD_SIZE", os.environ.get("MS_WORKER_NUM", ""))
    if value.strip().isdigit():
        return int(value)
    return (config.cp_size or 1) * config.tp


def model_shape(config: TrainConfig) -> ModelShape:
    """The sizes of the model to train (``--model``'s config.json is read, not its weights);
    ``ValueError`` naming ``--tp`` when it does not split them (the rules of the tensor-parallel
    plan, checked here before any communication)."""
    if config.model_dir is None:
        shape = ModelShape.of(config.model)
    else:
        from hyperpar_gdn.integrations.transformers.model_config import read_config

        shape = ModelShape.of(read_config(config.model_dir), where=f"--model {config.model_dir}: config.json")
    if error := tp_split_error(shape, config.tp):
        raise ValueError(f"--tp {config.tp} with {config.model_name}: {error}")
    return shape


def step_options(config: TrainConfig, world_size: int, *, platform: str) -> StepOptions:
    """:class:`StepOptions` of this run on ``world_size`` ranks of ``platform``."""
    dp, cp, tp = config.mesh_shape(world_size)
    runtime = "torch" if config.model_dir is None else "torch+transformers"
    return StepOptions(
        seq_len=config.seq_len,
        rows=config.batch_size // dp,
        cp=cp,
        tp=tp,
        world_size=world_size,
        cp_mode=config.cp_mode,
        layout=config.token_layout(),
        ac=config.ac,
        dtype=config.dtype,
        fsdp=config.fsdp,
        check_parity=config.check_parity,
        packed=config.doc_boundaries,
        attention=attention_path(),
        runtime_bytes=RUNTIME_BYTES[runtime] if platform == "cpu" else 0,
        kept_heap=platform == "cpu",  # scripts/train.py keeps freed host memory on the CPU
    )


def budget_of(config: TrainConfig, platform: str, world_size: int) -> tuple[int, str]:
    """(bytes per rank, where from): ``--max-memory-gb``, else the platform's budget."""
    if config.max_memory_gb is not None:
        return int(config.max_memory_gb * GIB), f"--max-memory-gb {config.max_memory_gb:g}"
    budget, source = rank_budget(platform, ranks_here=local_ranks(world_size))
    if platform == "cpu":  # what this process already holds (the framework) is its own
        budget += _own_rss()
        source += " + what this process holds"
    return budget, source


def _own_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _flags(opts: StepOptions, other: StepOptions) -> str:
    """The command-line options that turn ``opts`` into ``other``."""
    flags = [f"--cp-size {other.cp} ({count_ranks(other.world_size)})"] if other.cp != opts.cp else []
    flags += ["--ac"] if other.ac != opts.ac else []
    flags += [f"--dtype {other.dtype}"] if other.dtype != opts.dtype else []
    return " ".join(flags)


def _no_plan_on(config: TrainConfig, platform: str) -> bool:
    """True on MindSpore (no plan), after refusing the options that ask for one there."""
    if platform != "mindspore":
        return False
    if config.plan or config.max_memory_gb is not None:
        raise ValueError(
            "--plan and --max-memory-gb estimate torch's training step; the MindSpore trainer has no "
            "memory plan (HP_PLATFORM=mindspore)"
        )
    return True


def check_memory(config: TrainConfig, *, platform: str) -> None:
    """Refuse (:class:`MemoryBudgetError`, one line) a run whose largest rank's estimate exceeds
    the budget; on every rank, before any communication. MindSpore: ``--plan`` and
    ``--max-memory-gb`` are refused (ValueError), no check otherwise."""
    if _no_plan_on(config, platform):
        return
    world = launched_world_size(config)
    shape, opts = model_shape(config), step_options(config, world, platform=platform)
    budget, source = budget_of(config, platform, world)
    worst = largest_rank(shape, opts)
    if worst.total <= budget:
        return
    others = "; ".join(
        f"{_flags(opts, other)} {_gib(total)}{' (fits)' if total <= budget else ''}"
        for other, total in cheaper_options(shape, opts, budget)
    )
    tp = f", tp {opts.tp}" if opts.tp > 1 else ""
    raise MemoryBudgetError(
        f"the step needs an estimated {_gib(worst.total)} on rank {worst.rank} (T={opts.seq_len}, "
        f"cp {opts.cp}{tp}, --dtype {opts.dtype}{', --ac' if opts.ac else ''}), over the budget of "
        f"{_gib(budget)} per rank ({source}); estimates of other options: {others}; --plan shows the terms"
    )


def plan_lines(config: TrainConfig, *, platform: str) -> list[str]:
    """``--plan``'s table: every term for rank 0 and the largest rank, the total, the budget and
    the longest sequence that fits it."""
    _no_plan_on(config, platform)
    world = launched_world_size(config)
    shape, opts = model_shape(config), step_options(config, world, platform=platform)
    budget, source = budget_of(config, platform, world)
    first, worst = estimate(shape, opts, rank=0), largest_rank(shape, opts)
    shown: list[Estimate] = [first] if worst.rank == 0 else [first, worst]
    head = f"{'term':<16}" + "".join(f"{'rank ' + str(e.rank):>14}" for e in shown)
    lines = [
        f"memory plan of {config.model_name} ({shape.num_parameters():,} parameters), T={opts.seq_len}, "
        f"{opts.rows} row(s) per replica, {count_ranks(world)} = dp {world // (opts.cp * opts.tp)} x cp {opts.cp}"
        f"{f' x tp {opts.tp}' if opts.tp > 1 else ''} "
        f"(--cp-mode {opts.cp_mode}, --cp-layout {opts.layout}), --dtype {opts.dtype}"
        f"{', --ac' if opts.ac else ''}{', --fsdp' if opts.fsdp else ''}, attention path {opts.attention}",
        head,
    ]
    for term in TERMS:
        lines.append(f"{term:<16}" + "".join(f"{_gib(e.terms[term]):>14}" for e in shown))
    lines.append(f"{'peak':<16}" + "".join(f"{_gib(e.total):>14}" for e in shown))
    lines.append(
        "peak = runtime + parameters + gradients + optimizer + "
        "max(activations + communication + max(loss, backward) + heap holes, gradient sync)"
    )
    longest = longest_seq_len(shape, opts, budget)
    verdict = "fits" if worst.total <= budget else "does not fit"
    lines.append(f"budget {_gib(budget)} per rank ({source}): this run {verdict}")
    lines.append(
        f"longest --seq-len within the budget with these options: {longest}"
        if longest
        else "no --seq-len fits the budget with these options"
    )
    return lines
