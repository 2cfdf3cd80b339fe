"""Peak memory per rank of one whole training step of a transformers Qwen3.5 model with Qwen3.5's
248,320-token vocabulary, under context parallelism, on torch (CPU: peak RSS; CUDA: the allocator).

One step is what ``scripts/train.py`` does: the CP shard of a [1, T] batch, the model (p2p CP on
its GDN layers, all-gathered K/V on its attention layers, ``--ac`` checkpointing per layer), the
chunked LM loss from the final hidden states (:func:`hyperpar_gdn.ops.lm_loss.lm_loss_sum`, as the
trainer), backward, the gradient all-reduce over the CP group and an AdamW step. Every measurement
runs in freshly forked ranks (gloo), so a step's peak is not hidden by an earlier one. Three parts:

- ``table``: cp in ``--cp-sizes`` x ``--dtypes`` (fp32, bf16 autocast) at ``--seq-len``;
- ``search``: per cp, the longest T (a multiple of ``--t-step`` x cp) whose step fits
  ``--budget-gib`` per rank: doubling from ``--seq-len``, then bisection;
- ``loss``: the chunked loss against the logits path (``[1, T, V]`` logits and cross-entropy, what
  the trainer did before) at ``--seq-len`` on one rank, for the whole step and for the loss alone
  (forward and backward of the loss from fixed hidden states): peak growth and time, in turns
  (``--repeats`` rounds, fresh processes, medians).

Results: JSON (``--out``) and a plot of peak memory per rank against T beside it.

Usage: ``python scripts/bench_memory.py --ac --seq-len 2048 --cp-sizes 1 2 4 --budget-gib 4``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hyperpar_gdn.cli import HelpFormatter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cp import _fork_ranks  # noqa: E402  (process launch and collection, shared)

VOCAB = 248_320
PARTS = ("table", "loss", "search")
GIB = 2**30


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_model(hidden: int, layers: int) -> Any:
    """A random transformers Qwen3.5 text model with the 248,320-token vocabulary (tied head)."""
    import torch
    import transformers

    heads = max(1, hidden // 64)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config)


def _step_main(rank: int, cp: int, port: int, job: dict[str, Any], queue: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(cp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HP_PLATFORM="cpu"
    )
    try:
        import torch

        torch.set_num_threads(job["threads"])
        queue.put((rank, "ok", _measure_step(rank, cp, job)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _measure_step(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """Build, then time and measure training steps; the first step's peak is the one reported."""
    import torch
    import torch.nn.functional as F

    from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
    from hyperpar_gdn.integrations.transformers.lm_head import hidden_and_head
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum
    from hyperpar_gdn.platform import get_platform
    from hyperpar_gdn.train.sharding import apply_activation_checkpointing

    platform = get_platform("cpu")
    platform.init_distributed(timeout_s=600)
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = build_model(job["hidden"], job["layers"]).train()
    apply_context_parallel(model, mesh, mode="p2p")
    if job["ac"]:
        apply_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (1, job["seq_len"]), generator=torch.Generator().manual_seed(1))
    shard = shard_for_context_parallel(mesh, ids)
    count = float((ids[:, 1:] >= 0).sum())
    bf16 = job["dtype"] == "bf16"

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if job["loss"] == "chunked":
                hidden, head = hidden_and_head(model, shard.input_ids, transformers=True, cu_seqlens=None)
        if job["loss"] == "chunked":
            loss_sum = lm_loss_sum(hidden.to(torch.bfloat16) if bf16 else hidden, head, shard.labels)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=shard.input_ids, use_cache=False).logits
            loss_sum = F.cross_entropy(
                logits.float().reshape(-1, VOCAB), shard.labels.reshape(-1), reduction="sum"
            )
        (loss_sum / count).backward()
        for p in model.parameters():  # the CP group's gradient shares add up
            platform.collectives.all_reduce_sum(p.grad, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.detach())

    before = _rss_bytes()
    times = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _peak_bytes()
    platform.destroy()
    return {"rss_before": before, "peak": peak, "growth": peak - before, "seconds": times}


def _loss_main(rank: int, cp: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """The loss alone: forward and backward from fixed hidden states [1, T, C] and head [V, C]."""
    try:
        import torch
        import torch.nn.functional as F

        from hyperpar_gdn.ops.lm_loss import lm_loss_sum

        torch.set_num_threads(job["threads"])
        gen = torch.Generator().manual_seed(2)
        hidden = torch.randn(1, job["seq_len"], job["hidden"], generator=gen).requires_grad_()
        head = (0.02 * torch.randn(VOCAB, job["hidden"], generator=gen)).requires_grad_()
        labels = torch.randint(0, VOCAB, (1, job["seq_len"]), generator=gen)
        before = _rss_bytes()
        start = time.perf_counter()
        if job["loss"] == "chunked":
            loss = lm_loss_sum(hidden, head, labels)
        else:
            loss = F.cross_entropy((hidden @ head.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
        loss.backward()
        seconds = time.perf_counter() - start
        queue.put((rank, "ok", {"growth": _peak_bytes() - before, "seconds": [seconds], "loss": float(loss)}))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_step(cp: int, **job: Any) -> dict[str, Any]:
    """One configuration on ``cp`` fresh ranks; the largest peak over the ranks."""
    ranks = _fork_ranks(_step_main, cp, (job,), timeout_s=job["timeout_s"])
    return {
        **{k: v for k, v in job.items() if k != "timeout_s"},
        "cp": cp,
        "peak_per_rank": max(r["peak"] for r in ranks),
        "growth_per_rank": max(r["growth"] for r in ranks),
        "step_seconds": statistics.median(
            max(r["seconds"][i] for r in ranks) for i in range(len(ranks[0]["seconds"]))
        ),
    }


def search_longest(
    cp: int, budget: int, job: dict[str, Any], *, start: int, t_step: int, limit: int
) -> dict[str, Any]:
    """The longest T (a multiple of t_step * cp) whose step peaks within ``budget`` per rank."""
    unit = t_step * cp
    probes: list[dict[str, Any]] = []

    def fits(t: int) -> bool:
        row = run_step(cp, **{**job, "seq_len": t})
        probes.append(row)
        print(f"  search cp={cp} T={t}: peak {row['peak_per_rank'] / GIB:.2f} GiB per rank", flush=True)
        return row["peak_per_rank"] <= budget

    lo, hi = 0, max(unit, start // unit * unit)
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + unit)
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"cp": cp, "longest_seq_len": lo, "budget_bytes": budget, "probes": probes}


def compare_losses(job: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The chunked loss against the logits path, whole step and loss alone, in turns."""
    out: dict[str, Any] = {}
    for part, target in (("step", _step_main), ("loss_alone", _loss_main)):
        rows: dict[str, list[dict[str, Any]]] = {"logits": [], "chunked": []}
        for _ in range(repeats):
            for loss in ("logits", "chunked"):
                result = _fork_ranks(target, 1, ({**job, "loss": loss},), timeout_s=job["timeout_s"])[0]
                rows[loss].append(result)
        summary = {
            loss: {
                "growth": statistics.median(r["growth"] for r in rs),
                "seconds": statistics.median(s for r in rs for s in r["seconds"][-1:]),
            }
            for loss, rs in rows.items()
        }
        summary["growth_ratio"] = summary["chunked"]["growth"] / summary["logits"]["growth"]
        summary["time_ratio"] = summary["chunked"]["seconds"] / summary["logits"]["seconds"]
        out[part] = summary
        print(
            f"  {part}: growth {summary['logits']['growth'] / GIB:.2f} -> {summary['chunked']['growth'] / GIB:.2f} GiB "
            f"(x{summary['growth_ratio']:.2f}), time {summary['logits']['seconds']:.2f} -> "
            f"{summary['chunked']['seconds']:.2f} s (x{summary['time_ratio']:.2f})",
            flush=True,
        )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for entry in result["search"]:
        probes = sorted(entry["probes"], key=lambda r: r["seq_len"])
        ax.plot(
            [r["seq_len"] for r in probes],
            [r["peak_per_rank"] / GIB for r in probes],
            "o-",
            label=f"cp={entry['cp']}",
        )
    ax.axhline(result["budget_gib"], color="gray", linestyle="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.set_title(f"Qwen3.5 V=248,320, hidden {result['hidden']}, {result['layers']} layers, --ac")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048, help="T of the table and the loss comparison")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="CP sizes of the table")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["fp32", "bf16"],
        default=["fp32", "bf16"],
        help="compute dtypes of the table",
    )
    parser.add_argument("--ac", action="store_true", help="activation checkpointing per decoder layer")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (multiple of 64)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="per-rank budget of the search (default: none, no search)",
    )
    parser.add_argument("--t-step", type=int, default=256, help="the search's T is a multiple of this x cp")
    parser.add_argument("--t-limit", type=int, default=1 << 16, help="the search stops at this T")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the loss comparison (0: skip)")
    parser.add_argument("--steps", type=int, default=2, help="steps per measurement (the first one's peak)")
    parser.add_argument("--total-threads", type=int, default=2, help="split over the ranks")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="seconds per measurement process")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure")
    parser.add_argument(
        "--out", type=Path, default=Path("bench_memory.json"), help="JSON file of the results"
    )
    args = parser.parse_args(argv)
    if args.hidden % 64:
        raise SystemExit(f"--hidden {args.hidden} must be a multiple of 64")
    base = {
        "hidden": args.hidden,
        "layers": args.layers,
        "ac": args.ac,
        "steps": args.steps,
        "loss": "chunked",
        "dtype": "fp32",
        "timeout_s": args.timeout_s,
    }
    result: dict[str, Any] = {
        "vocab": VOCAB,
        "hidden": args.hidden,
        "layers": args.layers,
        "ac": args.ac,
        "memory_kind": "peak RSS",
        "loadavg_start": os.getloadavg(),
        "table": [],
        "search": [],
    }
    for cp in args.cp_sizes if "table" in args.parts else ():
        for dtype in args.dtypes:
            threads = max(1, args.total_threads // cp)
            row = run_step(cp, **{**base, "dtype": dtype, "seq_len": args.seq_len, "threads": threads})
            result["table"].append(row)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            print(
                f"cp={cp} {dtype} T={args.seq_len}: peak {row['peak_per_rank'] / GIB:.2f} GiB per rank "
                f"(step growth {row['growth_per_rank'] / GIB:.2f} GiB), {row['step_seconds']:.2f} s",
                flush=True,
            )
    if args.repeats and "loss" in args.parts:
        job = {**base, "seq_len": args.seq_len, "threads": args.total_threads}
        result["loss_vs_logits"] = compare_losses(job, args.repeats)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.budget_gib is not None and "search" in args.parts:
        result["budget_gib"] = args.budget_gib
        for cp in args.cp_sizes:
            job = {**base, "steps": 1, "threads": max(1, args.total_threads // cp)}
            entry = search_longest(
                cp,
                int(args.budget_gib * GIB),
                job,
                start=args.seq_len,
                t_step=args.t_step,
                limit=args.t_limit,
            )
            result["search"].append(entry)
            args.out.write_text(json.dumps(result, indent=2) + "\n")  # what is done so far
            print(
                f"cp={cp}: longest T within {args.budget_gib} GiB per rank: {entry['longest_seq_len']}",
                flush=True,
            )
    result["loadavg_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result["search"]:
        plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
