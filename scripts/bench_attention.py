"""Benchmark causal softmax attention: ours against torch's SDPA, and MindSpore's memory against T.

Two parts, each a case of the benchmark harness (:mod:`benchkit`: alternating rounds, a fresh
process per point, JSON and PNG):

- ``torch``: one process, ``--threads`` threads (1), q ``[1, 6, T, 256]``, k and v ``[1, 1, T, 256]``
  (6 query heads over 1 KV head), fp32, T = ``--T`` (8192), forward+backward (gradients of q, k,
  v for a fixed cotangent). ``ours`` is :func:`hyperpar_gdn.ops.attention.softmax.attention` on the
  automatic path (torch CPU: the flash kernel per rectangle, merged by log-sum-exp); ``sdpa`` is
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``. They take turns for
  ``--repeats`` rounds after a warm-up; the target is ours / sdpa <= 1.1 (ratio of medians).
  ``--blockwise`` adds the generic blockwise path (what MindSpore on CPU runs) to the rounds.
- ``mindspore``: the MindSpore ``CausalSelfAttention`` layer (hidden 512, the same heads), one
  forward+backward per T in ``--ms-T`` (2048 4096 8192 16384), each in a fresh process after a
  warm-up step at T = 256: the peak RSS growth of the step (``ru_maxrss``) and its time; the dense reference path
  (``HP_ATTENTION=reference``, which materializes the ``[B, H, T, T]`` scores) at the T in
  ``--ms-dense-T`` for comparison. Blockwise memory should grow linearly in T.

Usage: ``python scripts/bench_attention.py [--T 8192 --repeats 3 --ms-T 2048 4096 8192 16384]``;
``--skip-torch`` / ``--skip-mindspore``. Writes ``results/bench_attention.json`` and
``results/bench_attention.png`` (time and memory of the MindSpore layer against T); the MindSpore
rows also go to ``results/bench_attention_mindspore.json`` and ``.png`` after every row. The load
average before and after is in the JSON (and beside every MindSpore row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchkit.machine import load_average, peak_rss_bytes
from benchkit.output import Panel, save_png, write_json
from benchkit.ranks import in_fresh_process
from benchkit.timing import alternating_rounds, compare
from hyperpar_gdn.cli import HelpFormatter

TARGET_OURS_OVER_SDPA = 1.1
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 6, 1, 256, 512
WARMUP_T = 256


def torch_case(seq_len: int, repeats: int, warmup: int, threads: int, blockwise: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from hyperpar_gdn.ops.attention.softmax import attention
    from hyperpar_gdn.ops.attention.visibility import Tokens
    from hyperpar_gdn.platform import ops_for

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq_len, HEAD_DIM, generator=g).requires_grad_()
    k = torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, generator=g).requires_grad_()
    v = torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, generator=g).requires_grad_()
    cot = torch.randn(1, HEADS, seq_len, HEAD_DIM, generator=g)
    xp, tokens = ops_for(q), Tokens.span(0, seq_len)

    def ours(path: str = "auto") -> Any:
        o = attention(xp, q, k, v, queries=tokens, keys=tokens, path=path)
        return (o, *torch.autograd.grad((o * cot).sum(), (q, k, v)))

    def sdpa() -> Any:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (o, *torch.autograd.grad((o * cot).sum(), (q, k, v)))

    calls = {"ours": ours, "sdpa": sdpa}
    if blockwise:
        calls["blockwise"] = lambda: ours("blockwise")
    errors = {}
    expected = sdpa()
    for name, fn in calls.items():
        got = fn()
        errors[name] = max(
            ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected, strict=True)
        )
    times = alternating_rounds(calls, repeats=repeats, warmup=warmup)
    ratio = compare(times["ours"], times["sdpa"])
    del ratio["round_ratios"]
    ratio.update(
        target=TARGET_OURS_OVER_SDPA, within_target=ratio["ratio_of_medians"] <= TARGET_OURS_OVER_SDPA
    )
    return {
        "shape": {"B": 1, "H": HEADS, "Hkv": KV_HEADS, "D": HEAD_DIM, "T": seq_len, "dtype": "float32"},
        "threads": threads,
        "times_s": times,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "rel_err_vs_sdpa": errors,
        "ours_over_sdpa": ratio,
    }


def mindspore_step(seq_len: int, threads: int) -> dict[str, Any]:
    """One forward+backward of the MindSpore layer at ``seq_len`` (run in a fresh process)."""
    import mindspore as ms
    import numpy as np

    from hyperpar_gdn.models.mindspore import CausalSelfAttention
    from hyperpar_gdn.platform import get_platform

    get_platform("mindspore")  # PyNative, kernels launched synchronously
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=threads)
    layer = CausalSelfAttention(HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    rng = np.random.default_rng(0)

    def step(t: int) -> Any:
        x = ms.Tensor(rng.standard_normal((1, t, HIDDEN)).astype(np.float32))
        cot = ms.Tensor(rng.standard_normal((1, t, HIDDEN)).astype(np.float32))
        grad_fn = ms.grad(
            lambda inp: (layer(inp) * cot).sum(), grad_position=0, weights=layer.trainable_params()
        )
        dx, _ = grad_fn(x)
        return float(dx.sum().asnumpy())

    step(WARMUP_T)  # kernels and allocator warm, at a T whose memory is below every measured one
    rss_before = peak_rss_bytes()
    start = time.perf_counter()
    step(seq_len)
    elapsed = time.perf_counter() - start
    growth = peak_rss_bytes() - rss_before
    return {"T": seq_len, "time_s": elapsed, "peak_rss_growth_bytes": growth}


def mindspore_case(
    lengths: list[int], dense_lengths: list[int], threads: int, timeout_s: float, out: Path
) -> dict[str, Any]:
    """Each T in a fresh process, the dense reference beside the blockwise path at its T; the JSON
    and the plot are rewritten after every row (a long row may be cut by ``timeout_s``)."""
    rows: list[dict[str, Any]] = []
    jobs = [("reference", t) for t in dense_lengths] + [("auto", t) for t in lengths]
    jobs.sort(key=lambda job: (job[1], job[0] == "auto"))
    result = {"rows": rows}
    for path, t in jobs:
        env = {"HP_ATTENTION": path, "OMP_NUM_THREADS": str(threads)}
        argv = [__file__, "--ms-worker", str(t), "--threads", str(threads)]
        label = "blockwise" if path == "auto" else "dense reference"
        done = in_fresh_process(argv, env=env, timeout_s=timeout_s)
        if done is None:
            rows.append({"T": t, "path": label, "timed_out_after_s": timeout_s})
            print(f"  mindspore {label:>16} T={t:6d}: not done within {timeout_s:.0f} s", flush=True)
            continue
        row = {**done, "path": label, "load_average": load_average()}
        rows.append(row)
        print(
            f"  mindspore {label:>16} T={t:6d}: {row['time_s']:7.1f} s, "
            f"peak RSS growth {row['peak_rss_growth_bytes'] / 2**20:8.0f} MiB",
            flush=True,
        )
        done_rows = [r for r in rows if r["path"] == "blockwise" and "time_s" in r]
        result["blockwise_bytes_per_token"] = {r["T"]: r["peak_rss_growth_bytes"] / r["T"] for r in done_rows}
        write_json(out, {"mindspore": result})
        save_png(out.with_suffix(".png"), panels(result))
    return result


def panels(ms_result: dict[str, Any]) -> list[Panel]:
    """Time and peak RSS growth of the MindSpore layer against T, blockwise and dense."""
    time_panel = Panel("MindSpore CPU attention layer, forward+backward", "T", "s")
    memory_panel = Panel("peak RSS growth of the step", "T", "MiB")
    for row in (r for r in ms_result["rows"] if "time_s" in r):
        time_panel.lines.setdefault(row["path"], []).append((row["T"], row["time_s"]))
        memory_panel.lines.setdefault(row["path"], []).append(
            (row["T"], row["peak_rss_growth_bytes"] / 2**20)
        )
    return [time_panel, memory_panel]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--T", type=int, default=8192, help="tokens of the torch comparison")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the torch part")
    parser.add_argument(
        "--blockwise", action="store_true", help="also time the generic blockwise path on torch"
    )
    parser.add_argument(
        "--ms-T",
        type=int,
        nargs="+",
        default=[2048, 4096, 8192, 16384],
        help="sequence lengths of the MindSpore memory part",
    )
    parser.add_argument(
        "--ms-dense-T",
        type=int,
        nargs="*",
        default=[2048, 4096],
        help="sequence lengths of the MindSpore dense reference (none: skip)",
    )
    parser.add_argument("--ms-timeout", type=float, default=1800.0, help="seconds per MindSpore run")
    parser.add_argument("--skip-torch", action="store_true", help="leave out the torch part")
    parser.add_argument("--skip-mindspore", action="store_true", help="leave out the MindSpore part")
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_attention.json"), help="JSON file of the results"
    )
    parser.add_argument("--ms-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ms_worker is not None:
        print(json.dumps(mindspore_step(args.ms_worker, args.threads)))
        return 0
    result: dict[str, Any] = {"load_average_before": load_average()}
    if not args.skip_torch:
        result["torch"] = torch_case(args.T, args.repeats, args.warmup, args.threads, args.blockwise)
        r = result["torch"]
        print(
            f"torch T={args.T}: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in r["median_s"].items())
            + f"; ours/sdpa {r['ours_over_sdpa']['ratio_of_medians']:.3f} (target <= {TARGET_OURS_OVER_SDPA})"
            + f"; rel err vs sdpa {r['rel_err_vs_sdpa']}",
            flush=True,
        )
    if not args.skip_mindspore:
        partial = args.out.with_name(args.out.stem + "_mindspore.json")
        result["mindspore"] = mindspore_case(
            args.ms_T, args.ms_dense_T, args.threads, args.ms_timeout, partial
        )
    result["load_average_after"] = load_average()
    write_json(args.out, result)
    if "mindspore" in result:
        save_png(args.out.with_suffix(".png"), panels(result["mindspore"]))
    print(
        f"load average before {result['load_average_before']}, after {result['load_average_after']}; "
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
