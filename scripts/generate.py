"""Read a prompt under context parallelism, then continue it on one device or on the CP group.

    python scripts/make_tiny_qwen35.py tiny-qwen35
    torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 --prompt-file prompt.txt
    torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 --prompt-file prompt.txt \\
        --mode ulysses --sample --temperature 0.8 --top-k 20 --max-new-tokens 64
    HP_PLATFORM=mindspore msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \\
        --log_dir=msrun_log scripts/generate.py --model tiny-qwen35 --prompt-file prompt.txt
    torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 --prompt-file prompt.txt \
        --decode-on cp-group

Every rank loads the model (transformers' on torch, the MindSpore Qwen3.5 under
``HP_PLATFORM=mindspore``) and the tokenized prompt; ``hyperpar_gdn.prefill_context_parallel``
reads it under CP (``--mode``) and returns the last token's logits and the decoding state (for
transformers, its ``DynamicCache``); rank 0 then decodes greedily (or samples, ``--sample``) and
prints the continuation. Reported: the prefill time (median of ``--repeats``) and prompt tokens/s,
and the decoding tokens/s. ``--compare-one-device``: each round also times, on rank 0 alone while
the other ranks wait (so all see the same machine load), the same prefill at cp=1 (this package's
kernels on a one-rank mesh) and the framework's own one-device prefill (transformers' forward with
a cache; on MindSpore, ours without any style); ``--min-prompt-tokens`` repeats the prompt's
tokens up to a length (for long-prompt timing). ``--decode-on cp-group`` (transformers' models):
every rank decodes, keeping its share of the attention layers' K/V
(:mod:`hyperpar_gdn.inference.cp_decoding`); reported: the K/V cache bytes per rank against one
device's. Numbers go to ``--out`` (JSON).
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="transformers model directory")
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--mode", default="p2p", choices=("ulysses", "p2p", "all_gather"))
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu (HP_PLATFORM names the framework)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-prompt-tokens", type=int, default=0, help="repeat the prompt up to this length"
    )
    parser.add_argument("--repeats", type=int, default=1, help="prefill runs timed (median reported)")
    parser.add_argument("--compare-one-device", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the numbers (rank 0)")
    parser.add_argument(
        "--decode-on",
        default="one-device",
        choices=("one-device", "cp-group"),
        help="one-device: rank 0 decodes from the whole cache; cp-group: every rank decodes with its "
        "share of the attention K/V cache (transformers' models)",
    )
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.temperature <= 0 or args.top_k < 0 or args.min_prompt_tokens < 0:
        parser.error(
            f"--temperature={args.temperature} must be > 0, --top-k={args.top_k} and "
            f"--min-prompt-tokens={args.min_prompt_tokens} >= 0"
        )
    return args


def prompt_ids(args: argparse.Namespace) -> np.ndarray:
    from hyperpar_gdn.integrations.transformers.model_dir import load_tokenizer

    ids = load_tokenizer(args.model)(args.prompt_file.read_text())["input_ids"]
    if not ids:
        raise ValueError(f"--prompt-file {args.prompt_file} holds no tokens")
    repeats = -(-args.min_prompt_tokens // len(ids)) if args.min_prompt_tokens > len(ids) else 1
    return np.asarray((ids * repeats)[: max(len(ids), args.min_prompt_tokens)], np.int64).reshape(1, -1)


class Engine:
    """The model of one framework: load, prefill on one device, and one decoding step."""

    def __init__(self, platform: Any, path: Path) -> None:
        self.platform = platform
        self.mindspore = platform.name == "mindspore"
        if self.mindspore:
            from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM

            self.model = Qwen3_5ForCausalLM.from_pretrained(path)
        else:
            from hyperpar_gdn.integrations.transformers.model_dir import load_model_dir

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
        return logits.float().numpy()


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
    """Bytes of the attention layers' K and V in transformers' cache (what one device keeps)."""
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    return sum(int(t.numel()) * t.element_size() for layer in layers for t in (layer.keys, layer.values))


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
    # Over 80 lines: the run reads top to bottom (set up, timed prefill rounds, decoding, report).
    args = parse_args(argv)
    from hyperpar_gdn import (
        apply_context_parallel,
        get_platform,
        init_device_mesh,
        prefill_context_parallel,
        undo_context_parallel,
    )

    platform = get_platform()
    platform.init_distributed()
    mesh = init_device_mesh(args.device, (platform.world_size(),), mesh_dim_names=("cp",))
    rank, group, comm = platform.rank(), mesh.get_group(), platform.collectives
    engine = Engine(platform, args.model)
    if args.decode_on == "cp-group":  # refused on every rank before any prefill
        from hyperpar_gdn.inference.cp_decoding import check_sharded_decoding

        check_sharded_decoding(engine.model)
    ids_np = prompt_ids(args)
    ids = engine.tensor(ids_np)
    # a one-rank CP mesh per rank (collective to build), for the cp=1 timing on rank 0
    solo = init_device_mesh(args.device, (platform.world_size(), 1), mesh_dim_names=("dp", "cp"))["cp"]
    cp_times, one_times, solo_times = [], [], []
    for _ in range(args.repeats):
        apply_context_parallel(engine.model, mesh, mode=args.mode)
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
                apply_context_parallel(engine.model, solo, mode=args.mode)
                start = time.perf_counter()
                prefill_context_parallel(engine.model, solo, ids)
                solo_times.append(time.perf_counter() - start)
                undo_context_parallel(engine.model)
            comm.barrier(group)
    t = ids_np.shape[1]
    kv_one_device = kv_cache_bytes(state) if not engine.mindspore else None
    kv_per_rank = None
    if args.decode_on == "cp-group":
        from hyperpar_gdn.inference.cp_decoding import shard_cache

        sharded = shard_cache(engine.model, mesh, state, length=t)
        del state
        tokens, decode_s = decode(
            args, platform, logits, lambda token: engine.group_step(mesh, sharded, token)
        )
        kv_per_rank = comm.all_gather_int(sharded.kv_bytes(), group)
    elif rank == 0:
        engine.cache = state
        tokens, decode_s = decode(args, platform, logits, engine.step)
    if rank == 0:
        from hyperpar_gdn.integrations.transformers.model_dir import load_tokenizer

        text = load_tokenizer(args.model).decode(tokens)
        cp = platform.world_size()
        prefill_s = statistics.median(cp_times)
        result = {
            "framework": platform.name,
            "mode": args.mode,
            "cp": cp,
            "prompt_tokens": t,
            "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
            "prefill_s": cp_times,
            "prefill_tokens_per_s": t / prefill_s,
            "one_device_prefill_s": one_times or None,
            "cp1_prefill_s": solo_times or None,
            "decode_tokens_per_s": (args.max_new_tokens - 1) / decode_s if args.max_new_tokens > 1 else None,
            "decode_on": args.decode_on,
            "kv_cache_bytes_one_device": kv_one_device,
            "kv_cache_bytes_per_rank": kv_per_rank,
            "new_tokens": tokens,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]
            if Path("/proc/loadavg").exists()
            else None,
        }
        print(
            f"--- continuation ({'sampled' if args.sample else 'greedy'}, {len(tokens)} tokens) ---\n{text}"
        )
        print(
            f"prefill of {t} tokens at cp={cp} ({args.mode}): {prefill_s:.3f} s median, {t / prefill_s:.1f} tokens/s"
        )
        if one_times:
            one, solo_s = statistics.median(one_times), statistics.median(solo_times)
            print(
                f"same rounds, rank 0 alone: cp=1 {solo_s:.3f} s (speedup of cp={cp}: {solo_s / prefill_s:.2f}x), "
                f"{'transformers' if not engine.mindspore else 'one device'} {one:.3f} s "
                f"(speedup {one / prefill_s:.2f}x)"
            )
        if result["decode_tokens_per_s"]:
            where = "on the CP group" if args.decode_on == "cp-group" else "on one device"
            print(f"decoding {where}: {result['decode_tokens_per_s']:.1f} tokens/s")
        if kv_per_rank is not None:
            print(
                f"attention K/V cache: {kv_one_device} bytes on one device, per rank {kv_per_rank} "
                f"({max(kv_per_rank) / kv_one_device:.2f}x of one device on the largest)"
            )
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    comm.barrier(group)
    platform.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
