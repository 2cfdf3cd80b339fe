"""The command line of ``scripts/generate.py`` and its checks, all made on every rank before any
communication (a user error is one line on rank 0): the options (:func:`build_parser`,
:func:`parse_args`), the model directory and the prompt (:func:`check_paths`, :func:`prompt_ids`,
:func:`check_prompt_length`), the ranks (:func:`check_tp`, :func:`check_heads`) and the token
layout (:func:`token_layout`). The CP modes are :mod:`hyperpar_gdn.planning.plan`'s, spelled
as ``scripts/train.py`` spells them (``--cp-mode``, ``--cp-layout``, ``--cp-inner-size``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from hyperpar_gdn.cli import Parser, UsageError, launch_rank, print_line
from hyperpar_gdn.inference.sampling import Sampling

__all__ = [
    "build_parser",
    "check_heads",
    "check_paths",
    "check_prompt_length",
    "check_tp",
    "parse_args",
    "prompt_ids",
    "prompt_text",
    "token_layout",
]

SAMPLING_OPTIONS = {"temperature": 1.0, "top_k": 0, "seed": 0}
RENAMED = {"--mode": "--cp-mode", "--layout": "--cp-layout"}  # earlier names -> the ones train.py uses


def build_parser() -> argparse.ArgumentParser:
    from hyperpar_gdn.planning.plan import LAYOUTS, MODE_CHOICES

    parser = Parser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--model",
        type=Path,
        required=True,
        help="a transformers Qwen3.5 model directory (config.json, tokenizer; required)",
    )
    add(
        "--prompt-file",
        type=Path,
        default=None,
        help="a UTF-8 text file: the prompt to read under CP (default: the first paragraph of the "
        "built-in English text, hyperpar_gdn.corpus)",
    )
    add(
        "--cp-mode",
        default="p2p",
        choices=MODE_CHOICES,
        help="CP mode of the GDN layers during the prefill (scan: the log-depth state exchange; "
        "ulysses+<mode>: two levels, with --cp-inner-size; auto: the mode the cost model predicts "
        "fastest for this model and prompt)",
    )
    add(
        "--cp-layout",
        default=None,
        choices=LAYOUTS,
        help="which tokens a rank reads: contiguous pieces, or head_tail (pieces r and 2cp-1-r of 2cp; "
        "T divisible by 2cp) (default: head_tail, the training default, for a model with "
        "softmax-attention layers when T divides into 2cp pieces of at least the conv halo, else "
        "contiguous)",
    )
    add(
        "--cp-inner-size",
        type=int,
        default=None,
        help="two-level --cp-mode ulysses+<state mode>: ranks per inner (ulysses) group, e.g. a node; "
        "required with those modes and only with them",
    )
    for old, new in RENAMED.items():  # the earlier spellings, still read (a note says the new one)
        add(old, dest=f"renamed_{new[2:].replace('-', '_')}", default=None, help=argparse.SUPPRESS)
    add("--device", default="cpu", help="cpu, cuda or npu (HP_PLATFORM names the framework)")
    add(
        "--gdn-kernel",
        default="auto",
        choices=("auto", "fla", "native"),
        help="the GDN layers' local kernel during the prefill: auto (fla's Triton kernels on CUDA and "
        "Ascend where they import, else ours), fla or native; named with its reason in the report",
    )
    add("--max-new-tokens", type=int, default=32, help="tokens to decode after the prompt (at least 1)")
    add("--sample", action="store_true", help="sample instead of greedy decoding (default: greedy)")
    add(
        "--temperature",
        type=float,
        default=None,
        help="softmax temperature of --sample, > 0 (default: 1.0; an error without --sample)",
    )
    add(
        "--top-k",
        type=int,
        default=None,
        help="--sample from the k likeliest tokens (default: 0 = all; an error without --sample)",
    )
    add(
        "--seed",
        type=int,
        default=None,
        help="random seed of --sample (default: 0; an error without --sample)",
    )
    add(
        "--min-prompt-tokens", type=int, default=0, help="repeat the prompt up to this length (0: as written)"
    )
    add(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (torch): the world is cp x tp, the model split by heads over tp",
    )
    add("--repeats", type=int, default=1, help="prefill runs timed (median reported)")
    add(
        "--compare-one-device",
        action="store_true",
        help="also time, on rank 0, the prefill at cp=1 and the framework's own one-device prefill",
    )
    add("--out", type=Path, default=None, help="JSON file of the numbers, written by rank 0 (default: none)")
    add(
        "--decode-on",
        default="one-device",
        choices=("one-device", "cp-group"),
        help="one-device: rank 0 decodes from the whole cache; cp-group: every rank decodes keeping its "
        "share of the attention K/V cache",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; raises ``UsageError`` naming the option (rank 0 reports it).
    ``args.sampling`` is the :class:`~hyperpar_gdn.inference.sampling.Sampling` it asks for."""
    from hyperpar_gdn.planning.plan import inner_size_option_error

    parser = build_parser()
    args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    for old, new in RENAMED.items():
        dest = new[2:].replace("-", "_")
        value = getattr(args, f"renamed_{dest}")
        delattr(args, f"renamed_{dest}")
        if value is None:
            continue
        if any(word == new or word.startswith(f"{new}=") for word in words):
            raise UsageError(f"{old} is the earlier name of {new}: give one of them")
        choices = parser._option_string_actions[new].choices
        if value not in choices:
            raise UsageError(f"{old} (now {new}) {value!r} is not one of {', '.join(choices)}")
        setattr(args, dest, value)
        if launch_rank() == 0:
            print_line(f"generate.py: note: {old} is now {new}, as in train.py")
    for name in ("max_new_tokens", "repeats", "tp"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    inner_error = inner_size_option_error(args.cp_mode, args.cp_inner_size)
    if inner_error is not None:
        raise UsageError(inner_error)
    given = {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}
    if args.tp > 1 and args.compare_one_device:
        raise UsageError(
            f"--compare-one-device times rank 0 alone; with --tp {args.tp} the model needs its TP group: "
            "leave out one of them"
        )
    if given and not args.sample:
        flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in given.items())
        raise UsageError(f"{flags} only apply to sampling; add --sample (without it decoding is greedy)")
    for name, default in SAMPLING_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.temperature <= 0 or args.top_k < 0 or args.min_prompt_tokens < 0:
        raise UsageError(
            f"--temperature={args.temperature} must be > 0, --top-k={args.top_k} and "
            f"--min-prompt-tokens={args.min_prompt_tokens} >= 0"
        )
    args.sampling = Sampling(
        sample=args.sample, temperature=args.temperature, top_k=args.top_k, seed=args.seed
    )
    return args


def check_paths(args: argparse.Namespace) -> None:
    """The model directory and the prompt file, checked on every rank before any communication."""
    model = args.model
    if not model.is_dir():
        raise FileNotFoundError(
            f"--model {model}: no such directory (expected a transformers model directory)"
        )
    if (model / "manifest.json").is_file() and not (model / "config.json").is_file():
        raise ValueError(
            f"--model {model} is a training checkpoint (train.py --save); generate.py reads a transformers "
            "model directory: train with --model DIR --export OUT and pass OUT"
        )
    if args.prompt_file is None:
        return
    if not args.prompt_file.is_file():
        raise FileNotFoundError(f"--prompt-file {args.prompt_file}: no such file")
    if not args.prompt_file.read_text().strip():
        raise ValueError(f"--prompt-file {args.prompt_file} is empty")


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt: ``--prompt-file``'s text, or the built-in text's first paragraph."""
    if args.prompt_file is not None:
        return args.prompt_file.read_text()
    from hyperpar_gdn.corpus import BUILTIN_CORPUS

    return BUILTIN_CORPUS.split("\n\n")[0]


def check_heads(args: argparse.Namespace, cp: int, tp: int = 1) -> None:
    """Ulysses splits the GDN value heads over the ranks (key heads may be shared; under --tp a TP
    rank's heads), a two-level mode over its inner groups: refuse a model whose value heads do
    not divide, or an inner size that does not divide cp."""
    from hyperpar_gdn.integrations.transformers.model_dir import gdn_dims
    from hyperpar_gdn.planning.plan import HEAD_MODES

    num_k_heads, num_v_heads, _ = gdn_dims(args.model)
    if args.cp_mode in HEAD_MODES and cp > 1 and num_v_heads % (cp * tp):
        over = f"cp={cp}" if tp == 1 else f"tp x cp = {tp} x {cp}"
        raise ValueError(
            f"--cp-mode {args.cp_mode} splits the GDN heads over {over} ranks, but {args.model} has "
            f"{num_k_heads} key and {num_v_heads} value heads; use --cp-mode p2p, all_gather, scan or auto, "
            "or a number of ranks that divides the value heads"
        )
    inner = args.cp_inner_size
    if inner is not None and cp > 1 and (cp % inner or num_v_heads % (inner * tp)):
        raise ValueError(
            f"--cp-mode {args.cp_mode}: --cp-inner-size {inner} must divide cp={cp} and the "
            f"{num_v_heads} value heads of {args.model}" + (f" over tp={tp}" if tp > 1 else "")
        )


def check_tp(args: argparse.Namespace, platform: str, world: int) -> int:
    """The CP ranks ``world / --tp`` (every rank alike, before any communication)."""
    if args.tp > 1 and platform == "mindspore":
        raise ValueError(f"--tp {args.tp}: tensor parallelism runs on torch; run MindSpore with --tp 1")
    if world % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the {world} launched ranks (the mesh is cp x tp)")
    return world // args.tp


def kv_heads_factor(args: argparse.Namespace) -> int:
    """One device's attention K/V over a TP rank's: the K/V heads over those a rank keeps (1 when
    tp is a multiple of them)."""
    if args.tp == 1:
        return 1
    from hyperpar_gdn.integrations.transformers.model_config import text_config

    kv_heads = int(text_config(args.model)["num_key_value_heads"])
    return kv_heads // max(1, kv_heads // args.tp) if kv_heads % args.tp == 0 else kv_heads


def check_prompt_length(args: argparse.Namespace, t: int) -> None:
    """Refuse a prompt longer than the model's position range (``max_position_embeddings`` of its
    config.json), on every rank before any communication."""
    from hyperpar_gdn.integrations.transformers.model_dir import position_range

    limit = position_range(args.model)
    if limit is not None and t > limit:
        source = (
            f"--min-prompt-tokens {t}"
            if args.min_prompt_tokens == t
            else f"--prompt-file {args.prompt_file or '(the built-in prompt)'}"
        )
        raise ValueError(
            f"the prompt has T={t} tokens ({source}), more than the "
            f"position range of {args.model}: max_position_embeddings={limit}"
        )


def token_layout(args: argparse.Namespace, t: int, cp: int) -> str:
    """``--cp-layout``, or its default: head_tail when the model has softmax-attention layers and the
    T prompt tokens divide into 2cp equal pieces that hold the conv halo (W-1 tokens; one for
    ulysses), else contiguous. An explicit head_tail that does not divide is refused (the same
    error on every rank)."""
    from hyperpar_gdn.integrations.transformers.model_dir import gdn_dims, has_softmax_attention
    from hyperpar_gdn.planning.plan import HEAD_MODES

    divides = cp > 1 and t % (2 * cp) == 0
    if args.cp_layout is None:
        need = 1 if args.cp_mode in HEAD_MODES else gdn_dims(args.model)[2] - 1
        fits = divides and t // (2 * cp) >= need
        return "head_tail" if fits and has_softmax_attention(args.model) else "contiguous"
    if args.cp_layout == "head_tail" and cp > 1 and not divides:
        raise ValueError(
            f"--cp-layout head_tail cuts the prompt's T={t} tokens into 2 x cp = {2 * cp} equal pieces: use a "
            f"prompt (or --min-prompt-tokens) of a multiple of {2 * cp} tokens, or --cp-layout contiguous"
        )
    return args.cp_layout


def prompt_ids(args: argparse.Namespace) -> np.ndarray:
    from hyperpar_gdn.integrations.transformers.model_dir import load_tokenizer

    ids = load_tokenizer(args.model)(prompt_text(args))["input_ids"]
    if not ids:
        raise ValueError(f"--prompt-file {args.prompt_file} holds no tokens")
    repeats = -(-args.min_prompt_tokens // len(ids)) if args.min_prompt_tokens > len(ids) else 1
    return np.asarray((ids * repeats)[: max(len(ids), args.min_prompt_tokens)], np.int64).reshape(1, -1)
