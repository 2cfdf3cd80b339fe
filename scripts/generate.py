"""Read a prompt under context parallelism, then continue it on one device or on the CP group.

    python scripts/make_tiny_qwen35.py tiny-qwen35
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 \\
        --prompt-file prompt.txt --mode ulysses --sample --temperature 0.8 --top-k 20 --max-new-tokens 64
    HP_PLATFORM=mindspore OMP_NUM_THREADS=1 msrun --worker_num=2 --local_worker_num=2 --master_port=8118 \\
        --join=True --log_dir=msrun_log scripts/generate.py --model tiny-qwen35
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 \\
        --mode scan --layout head_tail --min-prompt-tokens 8192 --decode-on cp-group
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 scripts/generate.py --model tiny-qwen35 --tp 2 \\
        --decode-on cp-group

Without ``--prompt-file`` the prompt is the first paragraph of the built-in English text. A
continuation that decodes to whitespace only (the tiny model's random weights often repeat one
token) prints as its ``repr`` with the token ids.

Every rank loads the model (transformers' on torch, the MindSpore Qwen3.5 under
``HP_PLATFORM=mindspore``) and the tokenized prompt; ``hyperpar_gdn.prefill_context_parallel``
reads it under CP (``--mode``, ``--layout``) and returns the last token's logits and the decoding
state (for transformers, its ``DynamicCache``); rank 0 then decodes greedily (or samples, ``--sample``) and
prints the continuation. Reported: the prefill time (median of ``--repeats``) and prompt tokens/s,
and the decoding tokens/s. ``--compare-one-device``: each round also times, on rank 0 alone while
the other ranks wait (so all see the same machine load), the same prefill at cp=1 (this package's
kernels on a one-rank mesh) and the framework's own one-device prefill (transformers' forward with
a cache; on MindSpore, ours without any style); ``--min-prompt-tokens`` repeats the prompt's
tokens up to a length (for long-prompt timing). Numbers go to ``--out`` (JSON; draw several with
``scripts/plot_generate.py``). ``--decode-on cp-group`` (both frameworks): every rank
decodes, keeping its share of the attention layers' K/V (:mod:`hyperpar_gdn.inference.cp_decoding`);
reported: the K/V cache bytes per rank against one device's. ``--tp N`` (torch): the world is a
mesh (cp, tp), tp innermost; the model is split by heads over tp (``apply_tensor_parallel``)
before the prefill over cp; decoding runs on the first CP rank's TP group (``one-device``) or on
every rank (``cp-group``), each rank keeping its heads' states.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SAMPLING_OPTIONS = {"temperature": 1.0, "top_k": 0, "seed": 0}


def build_parser() -> argparse.ArgumentParser:
    from hyperpar_gdn.cli import Parser
    from hyperpar_gdn.planning.plan import LAYOUTS, MODES

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
        "--mode",
        default="p2p",
        choices=MODES,
        help="CP mode of the GDN layers during the prefill (scan: the log-depth state exchange)",
    )
    add(
        "--layout",
        default=None,
        choices=LAYOUTS,
        help="which tokens a rank reads: contiguous pieces, or head_tail (pieces r and 2cp-1-r of 2cp; "
        "T divisible by 2cp) (default: head_tail, the training default, for a model with "
        "softmax-attention layers when T divides into 2cp pieces of at least the conv halo, else "
        "contiguous)",
    )
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
    """The command line, checked; raises ``UsageError`` naming the option (rank 0 reports it)."""
    from hyperpar_gdn.cli import UsageError

    args = build_parser().parse_args(argv)
    for name in ("max_new_tokens", "repeats", "tp"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
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
    rank's heads): refuse a model whose value heads do not divide."""
    from hyperpar_gdn.integrations.transformers.model_dir import gdn_dims
    from hyperpar_gdn.planning.plan import HEAD_MODES

    num_k_heads, num_v_heads, _ = gdn_dims(args.model)
    if args.mode in HEAD_MODES and cp > 1 and num_v_heads % (cp * tp):
        over = f"cp={cp}" if tp == 1 else f"tp x cp = {tp} x {cp}"
        raise ValueError(
            f"--mode {args.mode} splits the GDN heads over {over} ranks, but {args.model} has {num_k_heads} key "
            f"and {num_v_heads} value heads; use --mode p2p, all_gather or scan, or a number of ranks that "
            "divides the value heads"
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
    """``--layout``, or its default: head_tail when the model has softmax-attention layers and the
    T prompt tokens divide into 2cp equal pieces that hold the conv halo (W-1 tokens; one for
    ulysses), else contiguous. An explicit head_tail that does not divide is refused (the same
    error on every rank)."""
    from hyperpar_gdn.integrations.transformers.model_dir import gdn_dims, has_softmax_attention
    from hyperpar_gdn.planning.plan import HEAD_MODES

    divides = cp > 1 and t % (2 * cp) == 0
    if args.layout is None:
        need = 1 if args.mode in HEAD_MODES else gdn_dims(args.model)[2] - 1
        fits = divides and t // (2 * cp) >= need
        return "head_tail" if fits and has_softmax_attention(args.model) else "contiguous"
    if args.layout == "head_tail" and cp > 1 and not divides:
        raise ValueError(
            f"--layout head_tail cuts the prompt's T={t} tokens into 2 x cp = {2 * cp} equal pieces: use a "
            f"prompt (or --min-prompt-tokens) of a multiple of {2 * cp} tokens, or --layout contiguous"
        )
    return args.layout


def prompt_ids(args: argparse.Namespace) -> np.ndarray:
    from hyperpar_gdn.integrations.transformers.model_dir import load_tokenizer

    ids = load_tokenizer(args.model)(prompt_text(args))["input_ids"]
    if not ids:
        raise ValueError(f"--prompt-file {args.prompt_file} holds no tokens")
    repeats = -(-args.min_prompt_tokens // len(ids)) if args.min_prompt_tokens > len(ids) else 1
    return np.asarray((ids * repeats)[: max(len(ids), args.min_prompt_tokens)], np.int64).reshape(1, -1)


class Engine:
    """The model of one framework: load, prefill on one device, and one decoding step."""

    def __init__(self, platform: Any, path: Path, *, device: str) -> None:
        self.platform = platform
        self.mindspore = platform.name == "mindspore"
        if self.mindspore:
            from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM

            self.model = Qwen3_5ForCausalLM.from_pretrained(path)
        else:
            from hyperpar_gdn.integrations.transformers.model_dir import load_model_dir
            from hyperpar_gdn.integrations.transformers.notices import hide_expected_notices

            hide_expected_notices(device)  # transformers' reference-kernel notices, on a CPU
            self.model = load_model_dir(path)[0].eval()
        self.cache: Any = None

    def tensor(self, ids: np.ndarray) -> Any:
        return self.platform.from_numpy(ids, dtype="int64")

    def one_device_prefill(self, ids: Any) -> Any:
        if self.mindspore:
            from hyperpar_gdn.inference.decoding import prefill

            return prefill(self.model, ids)
        import torch

        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True)
        return out.logits[:, -1], out.cache

    def step(self, token: np.ndarray) -> np.ndarray:
        """Logits ``[B, V]`` (numpy) after one more token per row ``[B, 1]``."""
        ids = self.tensor(token)
        if self.mindspore:
            from hyperpar_gdn.inference.decoding import decode_step

            logits, self.cache = decode_step(self.model, self.cache, ids)
            return self.platform.to_numpy(logits)
        import torch

        with torch.no_grad():
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1].float().numpy()

    def group_step(self, mesh: Any, sharded: Any, token: np.ndarray) -> np.ndarray:
        """:meth:`step` on the CP group with the K/V cache sharded (every rank calls it)."""
        from hyperpar_gdn.inference.cp_decoding import decode_step_context_parallel

        logits = decode_step_context_parallel(self.model, mesh, sharded, self.tensor(token))
        return self.platform.to_numpy(logits)


def decode(args: argparse.Namespace, platform: Any, logits: Any, step: Any) -> tuple[list[int], float]:
    """Pick ``--max-new-tokens`` tokens from the prefill's last logits, stepping with ``step``
    (numpy token ``[B, 1]`` -> numpy logits ``[B, V]``) -> (the tokens of row 0, seconds)."""
    rng = np.random.default_rng(args.seed)
    tokens, last = [], platform.to_numpy(logits)
    start = time.perf_counter()
    for i in range(args.max_new_tokens):
        token = pick(last, args, rng)
        tokens.append(int(token[0, 0]))
        if i + 1 < args.max_new_tokens:
            last = step(token)
    return tokens, time.perf_counter() - start


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of the attention layers' K and V in the prefill's cache (what one device keeps):
    transformers' ``DynamicCache``, or the MindSpore model's ``DecodingState``."""
    from hyperpar_gdn.inference.decoding import DecodingState

    if isinstance(cache, DecodingState):  # a GDN layer's pair is (conv [B, C, W], S): 3-d and 4-d
        pairs = [pair for pair in cache.layers if len(pair[0].shape) == len(pair[1].shape) == 4]
    else:
        pairs = [
            (layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None
        ]
    return sum(int(t.nbytes) for pair in pairs for t in pair)


def shown_text(text: str, tokens: list[int]) -> str:
    """The continuation as printed: ``text``, or, when it decodes to whitespace only (a tiny random
    model repeats one token), its ``repr`` and the token ids."""
    return text if text.strip() else f"{text!r} (whitespace only; token ids {tokens})"


def pick(logits: np.ndarray, args: argparse.Namespace, rng: np.random.Generator) -> np.ndarray:
    """The next token per row ``[B, 1]``: argmax, or a sample of softmax(logits / temperature)
    over the top-k."""
    if not args.sample:
        return logits.argmax(-1).reshape(-1, 1)
    z = logits.astype(np.float64) / args.temperature
    if args.top_k:
        kth = np.sort(z, -1)[:, -min(args.top_k, z.shape[-1])][:, None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.array([[rng.choice(p.shape[-1], p=row)] for row in p])


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0, or 2 after a user error (one line on rank 0), or 128 + N after signal N."""
    from hyperpar_gdn.cli import run_script
    from hyperpar_gdn.platform import PlatformUnavailableError

    user_errors = (ValueError, FileNotFoundError, NotADirectoryError, NotImplementedError)
    user_errors += (ModuleNotFoundError, PlatformUnavailableError)
    return run_script("generate.py", lambda: _generate(argv), user_errors=user_errors)


def _generate(argv: list[str] | None) -> int:
    args = parse_args(argv)
    check_paths(args)
    from hyperpar_gdn import get_platform, init_device_mesh

    platform = get_platform()
    owned = not platform.is_initialized()  # a caller's process group (tests) outlives this run
    platform.init_distributed()
    try:  # every check below raises on every rank alike, before the first collective
        cp = check_tp(args, platform.name, platform.world_size())
        check_heads(args, cp, args.tp)
        if args.tp == 1:
            mesh = init_device_mesh(args.device, (cp,), mesh_dim_names=("cp",))
        else:
            full = init_device_mesh(args.device, (cp, args.tp), mesh_dim_names=("cp", "tp"))
            mesh = full["cp"]
        from hyperpar_gdn.ops.gdn.kernels import resolve_kernel

        args.kernel_choice = resolve_kernel(args.gdn_kernel, platform=platform.name)
        ids_np = prompt_ids(args)
        check_prompt_length(args, ids_np.shape[1])
        args.layout = token_layout(args, ids_np.shape[1], cp)
        engine = Engine(platform, args.model, device=args.device)
        if args.tp > 1:  # heads first (a model the plan cannot split: one ValueError on every rank)
            from hyperpar_gdn import apply_tensor_parallel

            apply_tensor_parallel(engine.model, full["tp"])
        if args.decode_on == "cp-group":  # a model without a sharded cache: refused on every rank
            from hyperpar_gdn.inference.cp_decoding import check_sharded_decoding

            check_sharded_decoding(engine.model)
        _run(args, platform, mesh, engine, ids_np)
    finally:
        if owned:
            platform.destroy()
    return 0


def _run(args: argparse.Namespace, platform: Any, mesh: Any, engine: Engine, ids_np: np.ndarray) -> None:
    """The timed prefill rounds on every rank, then decoding and the report on rank 0."""
    from hyperpar_gdn import (
        apply_context_parallel,
        init_device_mesh,
        prefill_context_parallel,
        undo_context_parallel,
    )

    rank, group, comm = platform.rank(), mesh.get_group(), platform.collectives
    ids = engine.tensor(ids_np)
    # a one-rank CP mesh per rank (collective to build), for the cp=1 timing on rank 0
    solo = init_device_mesh(args.device, (platform.world_size(), 1), mesh_dim_names=("dp", "cp"))["cp"]
    cp_times, one_times, solo_times = [], [], []
    for _ in range(args.repeats):
        apply_context_parallel(engine.model, mesh, mode=args.mode, layout=args.layout, kernel=args.gdn_kernel)
        comm.barrier(group)
        start = time.perf_counter()
        logits, state = prefill_context_parallel(engine.model, mesh, ids)
        comm.barrier(group)
        cp_times.append(time.perf_counter() - start)
        undo_context_parallel(engine.model)
        if args.compare_one_device:
            if rank == 0:
                start = time.perf_counter()
                engine.one_device_prefill(ids)
                one_times.append(time.perf_counter() - start)
                apply_context_parallel(engine.model, solo, mode=args.mode, kernel=args.gdn_kernel)
                start = time.perf_counter()
                prefill_context_parallel(engine.model, solo, ids)
                solo_times.append(time.perf_counter() - start)
                undo_context_parallel(engine.model)
            comm.barrier(group)
    t = ids_np.shape[1]
    kv = (kv_cache_bytes(state) * kv_heads_factor(args), None)  # one device's, per rank
    if args.decode_on == "cp-group":
        from hyperpar_gdn.inference.cp_decoding import shard_cache

        sharded = shard_cache(engine.model, mesh, state, length=t)
        del state
        decoded = decode(args, platform, logits, lambda token: engine.group_step(mesh, sharded, token))
        kv = (kv[0], comm.all_gather_int(sharded.kv_bytes(), group))
    elif mesh.get_local_rank() == 0:  # rank 0 (with its TP group under --tp)
        engine.cache = state
        decoded = decode(args, platform, logits, engine.step)
    if rank == 0:
        _report(args, platform, engine, ids_np, decoded, kv, (cp_times, one_times, solo_times))
    comm.barrier(group)


def _report(
    args: argparse.Namespace,
    platform: Any,
    engine: Engine,
    ids_np: np.ndarray,
    decoded: tuple[list[int], float],
    kv: tuple[int | None, list[int] | None],
    times: tuple[list[float], list[float], list[float]],
) -> None:
    """Rank 0: print the continuation (``decoded``: tokens, seconds) and the numbers (``kv``: the
    attention K/V bytes of one device and, decoding on the CP group, of every rank)."""
    from hyperpar_gdn.integrations.transformers.model_config import text_config
    from hyperpar_gdn.planning.payoff import cp_advice

    cp_times, one_times, solo_times = times
    tokens, decode_s = decoded
    from hyperpar_gdn.integrations.transformers.model_dir import load_tokenizer

    text = load_tokenizer(args.model).decode(tokens)
    t, cp = ids_np.shape[1], platform.world_size() // args.tp
    prefill_s = statistics.median(cp_times)
    steps = args.max_new_tokens - 1  # decoding steps timed (the first token comes from the prefill)
    result = {
        "framework": "mindspore" if engine.mindspore else "torch",
        "device": args.device,
        "mode": args.mode,
        "layout": args.layout,
        "gdn_kernel": args.kernel_choice.name,
        "cp": cp,
        "tp": args.tp,
        "prompt_tokens": t,
        "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
        "prefill_s": cp_times,
        "prefill_tokens_per_s": t / prefill_s,
        "one_device_prefill_s": one_times or None,
        "cp1_prefill_s": solo_times or None,
        "decode_tokens_per_s": steps / decode_s if steps else None,
        "decode_s_per_token": decode_s / steps if steps else None,
        "decode_on": args.decode_on,
        "kv_cache_bytes_one_device": kv[0],
        "kv_cache_bytes_per_rank": kv[1],
        "new_tokens": tokens,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
    }
    print(f"--- continuation ({'sampled' if args.sample else 'greedy'}, {len(tokens)} tokens) ---")
    print(shown_text(text, tokens))
    print(
        f"prefill of {t} tokens at cp={cp}{f' x tp={args.tp}' if args.tp > 1 else ''} ({args.mode}, "
        f"{args.layout}): {prefill_s:.3f} s median, "
        f"{t / prefill_s:.1f} tokens/s"
    )
    print(f"GDN kernel: {args.kernel_choice.name} ({args.kernel_choice.reason})")
    advice = cp_advice(
        model_config=text_config(args.model),
        seq_len=t,
        cp=cp,
        mode=args.mode,
        layout=args.layout,
        device=args.device,
        fewer="fewer ranks (torchrun --nproc-per-node), or one process (python scripts/generate.py)",
    )
    if advice is not None:
        print(advice)
    if one_times:
        one, solo_s = statistics.median(one_times), statistics.median(solo_times)
        print(
            f"same rounds, rank 0 alone: cp=1 {solo_s:.3f} s (speedup of cp={cp}: {solo_s / prefill_s:.2f}x), "
            f"{'transformers' if not engine.mindspore else 'one device'} {one:.3f} s "
            f"(speedup {one / prefill_s:.2f}x)"
        )
    if result["decode_tokens_per_s"]:
        where = "on the CP group" if args.decode_on == "cp-group" else "on one device"
        print(
            f"decoding {where}: {result['decode_tokens_per_s']:.1f} tokens/s "
            f"({result['decode_s_per_token'] * 1e3:.1f} ms per token)"
        )
    if kv[1] is not None:
        ranks = "per rank" if args.tp == 1 else f"per CP rank (each of tp={args.tp} ranks its heads)"
        print(
            f"attention K/V cache: {kv[0]} bytes on one device, {ranks} {kv[1]} "
            f"({max(kv[1]) / kv[0]:.2f}x of one device on the largest)"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
