"""Alternating timing rounds and what is computed from them (ratios, slowest rank, machine bound).

On a shared machine other processes' load comes and goes; timing A for a while and then B for a
while charges that load to whichever ran at the time. Here every round runs every call once, in
turn, so load falls on all of them alike; ratios are then read three ways: the ratio of the
medians, the median of the per-round ratios (each round's pair saw the same load) and the ratio
of the fastest runs (least disturbed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "alternating_rounds",
    "compare",
    "cpu_percent",
    "machine_bound",
    "median_time",
    "rel_err",
    "slowest_per_round",
]


def alternating_rounds(
    calls: Mapping[str, Callable[[], Any] | None],
    *,
    repeats: int,
    warmup: int,
    barrier: Callable[[], None] | None = None,
    cpu_time: bool = False,
) -> dict[str, list[float]]:
    """Wall seconds of every call: ``warmup`` untimed rounds, then ``repeats`` rounds in which the
    calls take turns (one run each). Returns name -> ``repeats`` samples.

    On ranks of a process group pass ``barrier`` (called before every call, so all ranks start a
    call together) and give every rank the same names; a ``None`` call only waits at the barrier
    (e.g. a single-device step that only rank 0 runs) and gets no samples. With ``cpu_time`` the
    process CPU seconds are returned too, under ``<name>/cpu``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0; got repeats={repeats}, warmup={warmup}")
    times: dict[str, list[float]] = {}
    for name, fn in calls.items():
        if fn is not None:
            times[name] = []
            if cpu_time:
                times[f"{name}/cpu"] = []
    for round_index in range(warmup + repeats):
        for name, fn in calls.items():
            if barrier is not None:
                barrier()
            if fn is None:
                continue
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if round_index >= warmup:
                times[name].append(elapsed)
                if cpu_time:
                    times[f"{name}/cpu"].append(elapsed_cpu)
    return times


def median_time(fn: Callable[[], Any], *, repeats: int, warmup: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    return statistics.median(alternating_rounds({"fn": fn}, repeats=repeats, warmup=warmup)["fn"])


def compare(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """``numerator`` over ``denominator``, samples of the same alternating rounds: the ratio of
    the medians, the median of the per-round ratios, the ratio of the minima, the round ratios."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"need the same non-zero number of rounds; got {len(numerator)} and {len(denominator)}"
        )
    per_round = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {
        "ratio_of_medians": statistics.median(numerator) / statistics.median(denominator),
        "median_of_round_ratios": statistics.median(per_round),
        "ratio_of_minima": min(numerator) / min(denominator),
        "round_ratios": per_round,
    }


def cpu_percent(times: Mapping[str, Sequence[float]], name: str) -> float:
    """``name``'s process CPU seconds over its wall seconds, summed over the rounds of an
    ``alternating_rounds(..., cpu_time=True)`` result, in percent (above 100: the process used
    more than one core)."""
    return 100.0 * sum(times[f"{name}/cpu"]) / sum(times[name])


def slowest_per_round(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per round, the slowest rank's seconds (a CP step ends when its last rank does);
    ``per_rank[r][i]`` is rank r's seconds in round i."""
    rounds = {len(samples) for samples in per_rank}
    if len(rounds) != 1:
        raise ValueError(f"every rank needs the same number of rounds; got {sorted(rounds)}")
    return [max(column) for column in zip(*per_rank, strict=True)]


def machine_bound(single: Sequence[float], side_by_side: Sequence[float], cp: int) -> float:
    """The parallel efficiency this machine allows at ``cp`` processes: the work done by one busy
    process alone (``single``: the whole job) against ``cp`` busy processes side by side, each
    doing 1/cp of it without communicating (``side_by_side``: the slowest per round), over cp.
    Below 1 when the processes slow each other down (shared caches, memory bandwidth, other
    jobs); a CP step's efficiency is judged against it."""
    return statistics.median(single) / statistics.median(side_by_side) / cp


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|."""
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))
