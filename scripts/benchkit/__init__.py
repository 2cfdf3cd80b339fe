"""The benchmark harness: every ``scripts/bench_*.py`` is a short case of it.

Harness modules (use these in a new case):

- :mod:`benchkit.timing`: :func:`alternating_rounds` (every call once per round, in turn, so
  load from other processes falls on all of them alike; on ranks, with a barrier before each
  call), :func:`compare` (ratio of medians, median of round ratios, ratio of minima),
  :func:`slowest_per_round` (a CP step ends with its last rank) and :func:`machine_bound` (one
  busy process against cp busy processes side by side: the efficiency the machine allows).
- :mod:`benchkit.ranks`: :func:`on_ranks` (forked ranks in a real gloo group, through the
  library's :func:`hyperpar_gdn.platform.launch.run_ranks`, the launcher the tests use),
  :func:`on_msrun` (MindSpore workers) and :func:`in_fresh_process` (one point per process).
- :mod:`benchkit.machine`: versions, cores, load average, resident memory, freed host memory.
- :mod:`benchkit.output`: :func:`write_json` (after every finished part) and :func:`save_png`
  of :class:`Panel` s.

Case modules (what one benchmark measures, kept out of its script): :mod:`benchkit.gdn_ops`,
:mod:`benchkit.gdn_ops_mindspore`, :mod:`benchkit.gdn_packed` (``bench_ops``),
:mod:`benchkit.cp_layer` (``bench_cp``), :mod:`benchkit.memory_step` (``bench_memory``, ``bench_plan``),
:mod:`benchkit.plan_step` (``bench_plan``),
:mod:`benchkit.scale` and :mod:`benchkit.splits` (``bench_scale``), :mod:`benchkit.tp_memory` (``bench_tp_memory``), :mod:`benchkit.published` (``bench_published``), :mod:`benchkit.bf16_drift` (``bench_bf16_drift``).

A new case (``scripts/bench_<what>.py``; ``python scripts/bench_<what>.py`` puts ``scripts/`` on
``sys.path``, and pytest does too, see pyproject.toml)::

    import argparse, statistics
    from pathlib import Path
    from benchkit.machine import load_average, machine_info
    from benchkit.output import Panel, save_png, write_json
    from benchkit.ranks import on_ranks
    from benchkit.timing import alternating_rounds, machine_bound, slowest_per_round

    def measure(rank: int, cp: int, job: dict) -> dict[str, list[float]]:
        import torch
        from hyperpar_gdn.platform import get_platform
        t = job["seq_len"]
        x = torch.randn(t, 256)
        calls = {
            "single": (lambda: x @ x.T) if rank == 0 else None,  # rank 0 alone, the others wait
            "local": lambda: x[: t // cp] @ x.T,  # every rank its share, side by side
        }
        barrier = get_platform().collectives.barrier
        return alternating_rounds(calls, repeats=job["repeats"], warmup=1, barrier=lambda: barrier(None))

    def main() -> None:
        parser = argparse.ArgumentParser()
        parser.add_argument("--seq-len", type=int, default=2048)
        parser.add_argument("--cp", type=int, default=2)
        parser.add_argument("--out", type=Path, default=Path("results/bench_what.json"))
        args = parser.parse_args()
        ranks = on_ranks(measure, args.cp, {"seq_len": args.seq_len, "repeats": 3}, timeout_s=600)
        local = slowest_per_round([r["local"] for r in ranks])
        bound = machine_bound(ranks[0]["single"], local, args.cp)
        write_json(args.out, {"machine": machine_info(), "bound": bound, "local_s": local})
        save_png(args.out.with_suffix(".png"), [Panel("bound", "cp", "efficiency", lines={"x": [(args.cp, bound)]})])
        print(f"machine bound at cp={args.cp}: {bound:.3f}; load {load_average()[0]:.1f}")

Keep the case's comparison against its reference in the same run (an error column or an
agreement check beside the times), and its options and JSON keys stable: docs and tests read them.
"""
