"""The run of ``scripts/generate.py``: read a prompt under CP, decode, report.

:func:`main` checks the command line (:mod:`.generate_options`) on every rank, loads the model
(:class:`~hyperpar_gdn.inference.engine.Engine`), builds the CP plan (:func:`cp_plan`: the mode
asked for, or the cost model's for ``--cp-mode auto``), times the prefill rounds on every rank,
then decodes (:func:`~hyperpar_gdn.inference.sampling.decode`) on rank 0 or on the CP group and
prints the prompt, the continuation and the numbers on rank 0 (:func:`report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hyperpar_gdn.inference.engine import Engine, kv_cache_bytes
from hyperpar_gdn.inference.generate_options import (
    check_heads,
    check_paths,
    check_prompt_length,
    check_tp,
    kv_heads_factor,
    parse_args,
    prompt_ids,
    prompt_text,
    token_layout,
)
from hyperpar_gdn.inference.sampling import decode
from hyperpar_gdn.planning.plan import CPPlan

__all__ = ["cp_plan", "main", "shown_text"]

PROMPT_SHOWN_CHARS = 400  # a longer prompt is shown cut, with its length


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0, or 2 after a user error (one line on rank 0), or 128 + N after signal N."""
    from hyperpar_gdn.cli import run_script
    from hyperpar_gdn.platform import PlatformUnavailableError

    user_errors = (ValueError, FileNotFoundError, NotADirectoryError, NotImplementedError)
    user_errors += (ModuleNotFoundError, PlatformUnavailableError)
    return run_script("generate.py", lambda: _generate(argv), user_errors=user_errors)


def cp_plan(args: argparse.Namespace, model: Any, mesh: Any, t: int) -> CPPlan:
    """The prefill's plan for a prompt of ``t`` tokens on the CP ``mesh``: ``--cp-mode`` (at cp 1,
    where every mode is the one-device layer, a one-level mode), or the cost model's choice."""
    from hyperpar_gdn.distributed.parallelize import resolve_plan
    from hyperpar_gdn.planning.plan import SPECS
    from hyperpar_gdn.platform.memory_budget import local_ranks

    mode, inner_size = args.cp_mode, args.cp_inner_size
    if mesh.size() == 1 and (mode == "auto" or SPECS[mode].two_level):
        mode, inner_size = "p2p", None
    auto = mode == "auto"
    return resolve_plan(
        model,
        mesh,
        mode=mode,
        layout=args.cp_layout,
        inner_size=None if auto else inner_size,
        kernel=args.gdn_kernel,
        seq_len=t if auto else None,
        dtype="float32",
        devices_per_node=(local_ranks(0) or None) if auto else None,
    )


def _generate(argv: list[str] | None) -> int:
    args = parse_args(argv)
    check_paths(args)
    from hyperpar_gdn.distributed.mesh import init_device_mesh
    from hyperpar_gdn.platform import get_platform

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
        args.cp_layout = token_layout(args, ids_np.shape[1], cp)
        engine = Engine(platform, args.model, device=args.device)
        if args.tp > 1:  # heads first (a model the plan cannot split: one ValueError on every rank)
            from hyperpar_gdn.tensor_parallel.apply import apply_tensor_parallel

            apply_tensor_parallel(engine.model, full["tp"])
        if args.decode_on == "cp-group":  # a model without a sharded cache: refused on every rank
            from hyperpar_gdn.inference.cp_decoding import check_sharded_decoding

            check_sharded_decoding(engine.model)
        plan = cp_plan(args, engine.model, mesh, ids_np.shape[1])
        _run(args, platform, mesh, engine, ids_np, plan)
    finally:
        if owned:
            platform.destroy()
    return 0


def _run(
    args: argparse.Namespace, platform: Any, mesh: Any, engine: Engine, ids_np: np.ndarray, plan: CPPlan
) -> None:
    """The timed prefill rounds on every rank, then decoding and the report on rank 0."""
    from hyperpar_gdn.distributed.mesh import init_device_mesh
    from hyperpar_gdn.distributed.parallelize import apply_context_parallel, undo_context_parallel
    from hyperpar_gdn.inference.prefill import prefill_context_parallel
    from hyperpar_gdn.planning.plan import SPECS

    rank, group, comm = platform.rank(), mesh.get_group(), platform.collectives
    ids = engine.tensor(ids_np)
    # a one-rank CP mesh per rank (collective to build), for the cp=1 timing on rank 0
    solo = init_device_mesh(args.device, (platform.world_size(), 1), mesh_dim_names=("dp", "cp"))["cp"]
    solo_plan = plan if not SPECS[plan.mode].two_level else CPPlan(mode="p2p", kernel=plan.kernel)
    cp_times, one_times, solo_times = [], [], []
    for _ in range(args.repeats):
        apply_context_parallel(engine.model, mesh, plan=plan)
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
                apply_context_parallel(
                    engine.model, solo, plan=dataclasses.replace(solo_plan, layout="contiguous")
                )
                start = time.perf_counter()
                prefill_context_parallel(engine.model, solo, ids)
                solo_times.append(time.perf_counter() - start)
                undo_context_parallel(engine.model)
            comm.barrier(group)
    t = ids_np.shape[1]
    kv = (kv_cache_bytes(state) * kv_heads_factor(args), None)  # one device's, per rank
    first = platform.to_numpy(logits)
    options = {"max_new_tokens": args.max_new_tokens, "sampling": args.sampling}
    if args.decode_on == "cp-group":
        from hyperpar_gdn.inference.cp_decoding import shard_cache

        sharded = shard_cache(engine.model, mesh, state, length=t)
        del state
        decoded = decode(first, lambda token: engine.group_step(mesh, sharded, token), **options)
        kv = (kv[0], comm.all_gather_int(sharded.kv_bytes(), group))
    elif mesh.get_local_rank() == 0:  # rank 0 (with its TP group under --tp)
        engine.cache = state
        decoded = decode(first, engine.step, **options)
    if rank == 0:
        report(args, platform, engine, ids_np, plan, decoded, kv, (cp_times, one_times, solo_times))
    comm.barrier(group)


def shown_text(text: str, tokens: list[int]) -> str:
    """The continuation as printed: ``text`` without leading blank lines, or, when it decodes to
    whitespace only (a tiny random model repeats one token), its ``repr`` and the token ids."""
    return text.lstrip("\r\n") if text.strip() else f"{text!r} (whitespace only; token ids {tokens})"


def shown_prompt(args: argparse.Namespace, t: int) -> str:
    """The prompt as printed: its text (cut after :data:`PROMPT_SHOWN_CHARS` characters)."""
    text = prompt_text(args).strip()
    cut = text if len(text) <= PROMPT_SHOWN_CHARS else text[:PROMPT_SHOWN_CHARS] + " [...]"
    repeated = f", the text repeated up to --min-prompt-tokens {t}" if args.min_prompt_tokens > 0 else ""
    return f"--- prompt ({t} tokens{repeated}) ---\n{cut}"


def report(
    args: argparse.Namespace,
    platform: Any,
    engine: Engine,
    ids_np: np.ndarray,
    plan: CPPlan,
    decoded: tuple[list[int], float],
    kv: tuple[int | None, list[int] | None],
    times: tuple[list[float], list[float], list[float]],
) -> None:
    """Rank 0: print the prompt, the continuation (``decoded``: tokens, seconds) and the numbers
    (``kv``: the attention K/V bytes of one device and, decoding on the CP group, of every rank)."""
    from hyperpar_gdn.integrations.transformers.model_config import text_config
    from hyperpar_gdn.integrations.transformers.model_dir import load_tokenizer
    from hyperpar_gdn.planning.payoff import cp_advice

    cp_times, one_times, solo_times = times
    tokens, decode_s = decoded
    text = load_tokenizer(args.model).decode(tokens)
    t, cp = ids_np.shape[1], platform.world_size() // args.tp
    prefill_s = statistics.median(cp_times)
    steps = args.max_new_tokens - 1  # decoding steps timed (the first token comes from the prefill)
    result = {
        "framework": "mindspore" if engine.mindspore else "torch",
        "device": args.device,
        "mode": plan.mode,
        "mode_asked": args.cp_mode,
        "inner_size": plan.inner_size,
        "layout": plan.layout,
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
    print(shown_prompt(args, t))
    print(f"--- continuation ({'sampled' if args.sample else 'greedy'}, {len(tokens)} tokens) ---")
    print(shown_text(text, tokens))
    print("---")
    mode = plan.mode if args.cp_mode != "auto" else f"auto: {plan.mode}"
    inner = f", inner {plan.inner_size}" if plan.inner_size is not None else ""
    print(
        f"prefill of {t} tokens at cp={cp}{f' x tp={args.tp}' if args.tp > 1 else ''} ({mode}{inner}, "
        f"{plan.layout}): {prefill_s:.3f} s median, {t / prefill_s:.1f} tokens/s"
    )
    print(f"GDN kernel: {args.kernel_choice.name} ({args.kernel_choice.reason})")
    advice = cp_advice(
        model_config=text_config(args.model),
        seq_len=t,
        cp=cp,
        mode=plan.mode,
        layout=plan.layout,
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
