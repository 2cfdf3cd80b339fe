"""Whole-model parallel efficiency at cp ranks of one core each, both token layouts, every mode.

The model: transformers' ``Qwen3_5ForCausalLM`` with Qwen3.5-27B's head geometry divided by 4
(GDN 4 key / 12 value heads of 128; attention 6 query / 1 key-value heads of 256, partial rotary
0.25), 3 GDN layers and 1 softmax-attention layer, hidden 256 (``--vocab`` tokens, small, so that
the mixers and not the logits decide the step). One training step (forward, cross-entropy,
backward) of the whole sequence ``--seq-len`` on one process with one thread, against ``cp``
ranks with one thread each holding T/cp tokens, in the contiguous and the head_tail layout, per
GDN mode. The single-device step is the faster of transformers' own model (its torch GDN and SDPA
attention) and ours on one rank (``apply_context_parallel`` on a one-rank mesh).

Timed in alternating rounds on forked ranks (:mod:`benchkit`), as ``bench_cp``'s efficiency run: in every round
rank 0 times both single-device steps while the others wait at a barrier, then all ranks time the
plain model on their own tokens side by side (no communication: what the machine allows, the
"bound"), then each (layout, mode) CP step in turn. Efficiency = median best single time / median
over rounds of the slowest rank's CP time / cp. JSON (``--out``) and a PNG plot beside it; the
load average before and after is recorded (the machine is shared).

Usage: ``python scripts/bench_cp_model.py [--seq-lens 8192 16384 --cp 2 --repeats 3]``
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchkit.machine import keep_host_memory, load_average
from benchkit.output import Panel, save_png, write_json
from benchkit.ranks import on_ranks
from benchkit.timing import alternating_rounds, machine_bound, slowest_per_round
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.planning.plan import LAYOUTS, MODES

SINGLE = ("transformers", "ours")
LOCAL = "local"
TARGET = 0.88  # whole-model efficiency at cp=2 in every mode, head_tail, T=8192 and 16384


def model_config(vocab: int) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=256,
        linear_num_key_heads=4,
        linear_num_value_heads=12,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        attention_dropout=0.0,
    )


def measure(rank: int, cp: int, job: dict[str, Any]) -> dict[str, list[float]]:
    """One rank: every single-device (rank 0), local and (layout, mode) CP step in alternating
    rounds; name -> seconds per round after the warm-up."""
    import torch
    import transformers

    from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
    from hyperpar_gdn.distributed import DeviceMesh
    from hyperpar_gdn.distributed.batch import context_parallel_loss
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    mesh = init_device_mesh(platform.name, (cp,), mesh_dim_names=("cp",))
    config = model_config(job["vocab"])
    seq_len = job["seq_len"]

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.Qwen3_5ForCausalLM(config).train()

    ids = torch.randint(0, job["vocab"], (1, seq_len), generator=torch.Generator().manual_seed(1))

    def single_step(model: torch.nn.Module) -> None:  # the whole sequence, one process
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()

    def cp_step(model: torch.nn.Module, shard: Any, group_mesh: Any) -> None:
        model.zero_grad(set_to_none=True)
        logits = model(**shard.model_inputs(), use_cache=False).logits
        context_parallel_loss(logits, shard.labels, group_mesh).backward()

    solo = DeviceMesh.from_group(platform, None, [rank], mesh_dim_name="cp")
    # the same names on every rank (one barrier before each); the single steps run on rank 0 only
    steps: dict[str, Any] = {f"single/{kind}": None for kind in job["singles"]}
    if rank == 0 and "transformers" in job["singles"]:
        steps["single/transformers"] = (make_model(), None, None)
    if rank == 0 and "ours" in job["singles"]:
        steps["single/ours"] = (apply_context_parallel(make_model(), solo, mode="p2p"), None, None)
    # LOCAL: our model on this rank's T/cp tokens alone (a one-rank mesh), all ranks side by side
    local_shard = shard_for_context_parallel(solo, ids[:, rank * seq_len // cp : (rank + 1) * seq_len // cp])
    steps[LOCAL] = (apply_context_parallel(make_model(), solo, mode="p2p"), local_shard, solo)
    for layout in job["layouts"]:
        shard = shard_for_context_parallel(mesh, ids, layout=layout)
        for mode in job["modes"]:
            model = apply_context_parallel(make_model(), mesh, mode=mode, layout=layout)
            steps[f"{layout}/{mode}"] = (model, shard, mesh)

    def call(model: torch.nn.Module, shard: Any, group_mesh: Any) -> Any:
        return (lambda: single_step(model)) if shard is None else (lambda: cp_step(model, shard, group_mesh))

    calls = {name: None if step is None else call(*step) for name, step in steps.items()}
    barrier = platform.collectives.barrier
    return alternating_rounds(
        calls, repeats=job["repeats"], warmup=job["warmup"], barrier=lambda: barrier(None)
    )


def run(seq_len: int, cp: int, args: argparse.Namespace) -> dict[str, Any]:
    job = {
        "seq_len": seq_len,
        "vocab": args.vocab,
        "modes": args.modes,
        "layouts": args.layouts,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "singles": args.singles,
    }
    load_before = load_average()
    results = on_ranks(measure, cp, job, threads=1, timeout_s=args.timeout)

    def slowest(name: str) -> list[float]:
        return slowest_per_round([r[name] for r in results])

    singles = {kind: statistics.median(results[0][f"single/{kind}"]) for kind in args.singles}
    best_kind = min(singles, key=singles.get)
    single = singles[best_kind]
    local = slowest(LOCAL)
    rows = {}
    for layout in args.layouts:
        for mode in args.modes:
            per_round = slowest(f"{layout}/{mode}")
            rows[f"{layout}/{mode}"] = {
                "layout": layout,
                "mode": mode,
                "cp_slowest_rank_s": statistics.median(per_round),
                "parallel_efficiency": single / statistics.median(per_round) / cp,
                "rank_medians_s": [statistics.median(results[r][f"{layout}/{mode}"]) for r in range(cp)],
                "samples_slowest_rank_s": per_round,
            }
    return {
        "seq_len": seq_len,
        "cp": cp,
        "single_s": singles,
        "single_best": best_kind,
        "single_samples_s": {kind: results[0][f"single/{kind}"] for kind in args.singles},
        "local_side_by_side_s": statistics.median(local),
        "machine_bound_efficiency": machine_bound(results[0][f"single/{best_kind}"], local, cp),
        "rows": rows,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


def report(result: dict[str, Any]) -> None:
    singles = ", ".join(f"{kind} {s:.2f}s" for kind, s in result["single_s"].items())
    print(
        f"T={result['seq_len']} cp={result['cp']}: single step {singles} (best: {result['single_best']}); "
        f"plain model on T/cp side by side "
        f"{result['local_side_by_side_s']:.2f}s, machine bound {result['machine_bound_efficiency']:.3f}; "
        f"load {result['load_average_before'][0]:.1f} -> {result['load_average_after'][0]:.1f}"
    )
    print(f"{'layout':<12}{'mode':<16}{'cp step s':>10}{'efficiency':>12}{'per-rank medians s':>24}")
    for row in result["rows"].values():
        ranks = " ".join(f"{t:.2f}" for t in row["rank_medians_s"])
        print(
            f"{row['layout']:<12}{row['mode']:<16}{row['cp_slowest_rank_s']:>10.2f}"
            f"{row['parallel_efficiency']:>12.3f}{ranks:>24}"
        )


def panel(result: dict[str, Any]) -> Panel:
    """The efficiency of every (layout, mode) against the target and the machine bound."""
    bars = {
        f"{r['layout']}\n{r['mode']}": (
            r["parallel_efficiency"],
            "C0" if r["layout"] == "contiguous" else "C1",
        )
        for r in result["rows"].values()
    }
    hlines = {f"target {TARGET}": (TARGET, "--"), "machine bound": (result["machine_bound_efficiency"], ":")}
    title = f"T={result['seq_len']}, cp={result['cp']}, one core per rank"
    return Panel(title, "", "whole-model parallel efficiency", bars=bars, hlines=hlines, ylim=(0, 1.1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", default=[8192, 16384], help="total sequence lengths T to time"
    )
    parser.add_argument("--cp", type=int, default=2, help="ranks of the CP group")
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=MODES, help="CP modes of the GDN layers to time"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="token layouts to time"
    )
    parser.add_argument(
        "--singles",
        nargs="+",
        default=list(SINGLE),
        choices=SINGLE,
        help="one-device steps to time on rank 0 (the efficiency is against the faster)",
    )
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size of the model")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per sequence length")
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_cp_model.json"), help="JSON file of the results"
    )
    args = parser.parse_args()
    kept = keep_host_memory(True)  # forked ranks inherit it
    results = []
    for seq_len in args.seq_lens:
        if seq_len % (2 * args.cp):
            raise SystemExit(f"--seq-lens {seq_len} is not divisible by 2*cp = {2 * args.cp}")
        result = run(seq_len, args.cp, args)
        report(result)
        results.append(result)
        payload = {"results": results, "freed_host_memory_kept": kept, "target_efficiency": TARGET}
        write_json(args.out, payload)  # after every length: a long run keeps its numbers
    png = args.out.with_suffix(".png")
    save_png(png, [panel(result) for result in results], width=6, dpi=120)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
