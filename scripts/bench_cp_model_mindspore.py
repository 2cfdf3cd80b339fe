"""MindSpore's whole model at cp ranks against one process, every mode, both layouts, and torch's
same model in the same run.

The model is ``bench_cp_model``'s (transformers' Qwen3.5 with the 27B head ratios / 4, 3 GDN + 1
attention layers, hidden 256), written once as a transformers directory (``config.json`` +
safetensors, seed 0) and loaded by MindSpore's ``Qwen3_5ForCausalLM.from_pretrained`` and by
transformers. One training step = forward, the chunked LM loss (mean over the labelled tokens),
backward; fp32, one thread per process.

- torch (one forked rank): transformers' own model and ours (``apply_context_parallel`` on a
  one-rank mesh) on the whole sequence, in alternating rounds;
- MindSpore (msrun, ``--cp`` workers): in every round worker 0 runs the whole sequence alone
  (``single``; the others wait at a barrier), then every (layout, mode) CP step runs on all
  workers; efficiency = single / slowest worker's CP step / cp.

The losses are compared in the same run (MindSpore's CP loss against its single loss, and against
transformers'). JSON (``--out``) and a PNG beside it.

Usage: ``python scripts/bench_cp_model_mindspore.py --seq-lens 8192 --cp 2 --repeats 3`` (a quiet
machine); ``--seq-lens 64 --repeats 1 --warmup 0`` proves it works.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_cp_model import LAYOUTS, MODES

from benchkit.machine import load_average, machine_info
from benchkit.output import Panel, save_png, write_json
from benchkit.qwen35_steps import measure_torch, token_ids, write_model_dir
from benchkit.ranks import on_msrun, on_ranks
from benchkit.timing import alternating_rounds, cpu_percent, slowest_per_round
from hyperpar_gdn.cli import HelpFormatter

TARGET_EFFICIENCY = 0.85  # MindSpore's whole model at cp=2
TARGET_VS_TORCH = 1.5  # MindSpore's one-process step over torch's best one
LOSS_AGREEMENT = 1e-4  # relative, fp32


def mindspore_worker(args: argparse.Namespace) -> None:
    """One msrun worker (see the module docstring); writes its times and losses."""
    import mindspore as ms
    import numpy as np

    from hyperpar_gdn import apply_context_parallel, context_parallel_lm_loss, init_device_mesh
    from hyperpar_gdn import shard_for_context_parallel as shard_for
    from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum
    from hyperpar_gdn.platform import get_platform
    from hyperpar_gdn.platform.msrun import write_result

    platform = get_platform("mindspore")
    platform.init_distributed(timeout_s=args.timeout)  # binds this worker to its core (cpu_share)
    rank, cp = platform.rank(), platform.world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    tokens = token_ids(args.seq_len, args.vocab, np)
    ids = platform.from_numpy(tokens, dtype="int64")
    losses: dict[str, float] = {}

    def step_of(model: Any, input_ids: Any, loss_of: Any, name: str) -> Any:
        grad_fn = ms.value_and_grad(
            lambda x: loss_of(model.final_hidden_states(x), model.head_weight), None, model.trainable_params()
        )

        def step() -> None:
            loss, _ = grad_fn(input_ids)
            losses[name] = float(loss.asnumpy())

        return step

    calls: dict[str, Any] = {"single": None}
    if rank == 0:
        shifted = platform.from_numpy(np.append(tokens[:, 1:], [[-100]], axis=1), dtype="int64")
        count = args.seq_len - 1
        model = Qwen3_5ForCausalLM.from_pretrained(args.model_dir)
        calls["single"] = step_of(model, ids, lambda h, w: lm_loss_sum(h, w, shifted) / count, "single")
    for layout in args.layouts:
        shard = shard_for(mesh, ids, layout=layout)
        for mode in args.modes:
            model = apply_context_parallel(
                Qwen3_5ForCausalLM.from_pretrained(args.model_dir), mesh, mode=mode, layout=layout
            )
            calls[f"{layout}/{mode}"] = step_of(
                model,
                shard.input_ids,
                lambda h, w, labels=shard.labels: context_parallel_lm_loss(h, w, labels, mesh),
                f"{layout}/{mode}",
            )
    barrier = platform.collectives.barrier
    times = alternating_rounds(
        calls, repeats=args.repeats, warmup=args.warmup, barrier=lambda: barrier(None), cpu_time=True
    )
    share = asdict(platform.cpu_share) if platform.cpu_share else None  # the same on "single"
    write_result(rank, {"rank": rank, "times_s": times, "loss_share": losses, "cpu_share": share})
    platform.destroy()


def run(seq_len: int, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Both frameworks at one sequence length; the row of the JSON."""
    load_before = load_average()
    job = {"seq_len": seq_len, "vocab": args.vocab, "model_dir": str(model_dir)}
    torch_result = on_ranks(
        measure_torch, 1, {**job, "repeats": args.repeats, "warmup": args.warmup}, timeout_s=args.timeout
    )[0]
    worker_args = [
        "--as-msrun-worker",
        f"--seq-lens={seq_len}",
        f"--vocab={args.vocab}",
        f"--model-dir={model_dir}",
        f"--repeats={args.repeats}",
        f"--warmup={args.warmup}",
        f"--timeout={args.timeout}",
        "--modes",
        *args.modes,
        "--layouts",
        *args.layouts,
    ]
    workers = on_msrun(Path(__file__), args.cp, worker_args, timeout_s=args.timeout)
    torch_single = {name: statistics.median(t) for name, t in torch_result["times_s"].items()}
    single = statistics.median(workers[0]["times_s"]["single"])
    single_loss = workers[0]["loss_share"]["single"]
    rows = {}
    for name in workers[0]["times_s"]:
        if name == "single" or name.endswith("/cpu"):
            continue
        per_round = slowest_per_round([w["times_s"][name] for w in workers])
        loss = sum(w["loss_share"][name] for w in workers)  # each worker's term of the global mean
        rows[name] = {
            "cp_slowest_rank_s": statistics.median(per_round),
            "parallel_efficiency": single / statistics.median(per_round) / args.cp,
            "loss": loss,
            "loss_rel_diff": abs(loss - single_loss) / abs(single_loss),
            "samples_slowest_rank_s": per_round,
            "cpu_percent_per_rank": [cpu_percent(w["times_s"], name) for w in workers],
        }
    return {
        "seq_len": seq_len,
        "cp": args.cp,
        "torch_single_s": torch_single,
        "torch_loss": torch_result["loss"],
        "mindspore_single_s": single,
        "mindspore_single_loss": single_loss,
        "mindspore_single_cpu_percent": cpu_percent(workers[0]["times_s"], "single"),
        "cpu_share_per_rank": [w["cpu_share"] for w in workers],
        "mindspore_over_torch": single / min(torch_single.values()),
        "loss_rel_diff_vs_transformers": abs(single_loss - torch_result["loss"]["transformers"])
        / abs(torch_result["loss"]["transformers"]),
        "rows": rows,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


def report(result: dict[str, Any]) -> None:
    ts = result["torch_single_s"]
    print(
        f"T={result['seq_len']} cp={result['cp']}: one process: MindSpore {result['mindspore_single_s']:.2f}s, "
        f"torch transformers {ts['transformers']:.2f}s / ours {ts['ours']:.2f}s "
        f"(MindSpore / best torch {result['mindspore_over_torch']:.2f}x, target <= {TARGET_VS_TORCH}); "
        f"loss MindSpore {result['mindspore_single_loss']:.6f}, transformers {result['torch_loss']['transformers']:.6f}; "
        f"CPU {result['mindspore_single_cpu_percent']:.0f}%, cores per rank {result['cpu_share_per_rank']}"
    )
    print(f"{'layout/mode':<27}{'cp step s':>10}{'efficiency':>12}{'loss rel diff':>15}  CPU % per rank")
    for name, row in result["rows"].items():
        print(
            f"{name:<27}{row['cp_slowest_rank_s']:>10.2f}{row['parallel_efficiency']:>12.3f}"
            f"{row['loss_rel_diff']:>15.2e}  {' '.join(f'{c:.0f}' for c in row['cpu_percent_per_rank'])}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", default=[8192], help="total sequence lengths T to time"
    )
    parser.add_argument("--cp", type=int, default=2, help="msrun workers of the CP group")
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=MODES, help="CP modes of the GDN layers to time"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="token layouts to time"
    )
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size of the model")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per launch")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/bench_cp_model_mindspore.json"),
        help="JSON to write (the PNG beside it)",
    )
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--as-msrun-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_msrun_worker:  # inside msrun
        args.seq_len = args.seq_lens[0]
        mindspore_worker(args)
        return
    for seq_len in args.seq_lens:
        if seq_len % (2 * args.cp):
            raise SystemExit(f"--seq-lens {seq_len} is not divisible by 2*cp = {2 * args.cp}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_ms_model_") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", args.vocab)
        for seq_len in args.seq_lens:
            result = run(seq_len, args, model_dir)
            report(result)
            bad = {
                n: r["loss_rel_diff"]
                for n, r in result["rows"].items()
                if r["loss_rel_diff"] > LOSS_AGREEMENT
            }
            if result["loss_rel_diff_vs_transformers"] > LOSS_AGREEMENT:
                bad["one process vs transformers"] = result["loss_rel_diff_vs_transformers"]
            if bad:
                raise SystemExit(f"T={seq_len}: CP losses differ from the one-process loss: {bad}")
            results.append(result)
            write_json(args.out, {"machine": machine_info(), "results": results})
    panels = [
        Panel(
            f"MindSpore, T={r['seq_len']}, cp={r['cp']}",
            "",
            "whole-model parallel efficiency",
            bars={
                n.replace("/", "\n"): (row["parallel_efficiency"], "C0" if "contiguous" in n else "C1")
                for n, row in r["rows"].items()
            },
            hlines={f"target {TARGET_EFFICIENCY}": (TARGET_EFFICIENCY, "--")},
            ylim=(0, 1.1),
        )
        for r in results
    ]
    save_png(args.out.with_suffix(".png"), panels, width=6, dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
