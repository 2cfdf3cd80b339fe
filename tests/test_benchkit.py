"""The benchmark harness (scripts/benchkit): alternating rounds, the ratios and the machine bound
computed from them, and the new-case example of its docstring run end to end on 2 gloo ranks.
No timing is judged here, only what the harness computes and writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import benchkit
from benchkit.timing import alternating_rounds, compare, cpu_percent, machine_bound, slowest_per_round

ROOT = Path(__file__).resolve().parents[1]


def test_alternating_rounds_take_turns_after_the_warmup() -> None:
    order: list[str] = []
    calls = {"a": lambda: order.append("a"), "skip": None, "b": lambda: order.append("b")}
    barriers: list[int] = []
    times = alternating_rounds(calls, repeats=3, warmup=2, barrier=lambda: barriers.append(1), cpu_time=True)
    assert order == ["a", "b"] * 5  # every round runs every call once, in turn; warm-up included
    assert len(barriers) == 3 * 5  # a barrier before every call, the skipped one too
    assert sorted(times) == ["a", "a/cpu", "b", "b/cpu"]
    assert all(len(samples) == 3 and min(samples) >= 0 for samples in times.values())


@pytest.mark.parametrize(("repeats", "warmup"), [(0, 1), (2, -1)])
def test_alternating_rounds_refuse_bad_counts(repeats: int, warmup: int) -> None:
    with pytest.raises(ValueError, match=f"repeats={repeats}, warmup={warmup}"):
        alternating_rounds({"a": lambda: None}, repeats=repeats, warmup=warmup)


def test_compare_slowest_rank_and_machine_bound() -> None:
    ratio = compare([2.0, 6.0, 3.0], [1.0, 2.0, 3.0])
    assert ratio["ratio_of_medians"] == pytest.approx(1.5)
    assert ratio["round_ratios"] == pytest.approx([2.0, 3.0, 1.0])
    assert ratio["median_of_round_ratios"] == pytest.approx(2.0)
    assert ratio["ratio_of_minima"] == pytest.approx(2.0)
    assert slowest_per_round([[1.0, 5.0], [2.0, 4.0]]) == [2.0, 5.0]
    # one process: 4 s for all the work; two side by side: 2.5 s for half each -> 0.8 of ideal
    assert machine_bound([4.0, 4.0, 5.0], [2.5, 2.0, 3.0], 2) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="got 2 and 1"):
        compare([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        slowest_per_round([[1.0], [1.0, 2.0]])


def test_cpu_percent_is_cpu_over_wall_over_all_rounds() -> None:
    times = {"step": [2.0, 2.0], "step/cpu": [3.0, 2.0]}  # 5 s of CPU in 4 s: more than one core
    assert cpu_percent(times, "step") == pytest.approx(125.0)
    busy = alternating_rounds({"spin": lambda: sum(range(200_000))}, repeats=2, warmup=0, cpu_time=True)
    assert 0.0 < cpu_percent(busy, "spin") <= 100.0 * (os.cpu_count() or 1)


def test_docstring_case_runs_on_two_ranks(tmp_path: Path) -> None:
    """The ~30-line example of a new case in benchkit's docstring is a working benchmark."""
    match = re.search(
        r"sys.path``, and pytest does too, see pyproject.toml\)::\n\n(.*?)\n\n\S", benchkit.__doc__, re.S
    )
    assert match is not None, "the example block moved"
    code = "\n".join(line[4:] for line in match.group(1).splitlines())
    script = tmp_path / "bench_what.py"
    script.write_text(code + "\n\nmain()\n")
    out = tmp_path / "what.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(script), "--seq-len", "64", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["local_s"]) == 3 and result["bound"] > 0
    assert result["machine"]["cpu_count"] == os.cpu_count()
    assert out.with_suffix(".png").stat().st_size > 0
    assert "machine bound at cp=2" in done.stdout


def test_scale_predictions_and_their_map(tmp_path: Path) -> None:
    """bench_scale's far part (no ranks): both Qwen3.5 geometries on both machines, every point's
    choice feasible, ulysses refused where cp does not divide the value heads, and the map of
    winners drawn with one colour per mode in every panel."""
    import bench_scale

    from benchkit.output import save_png
    from benchkit.scale import FAR_CPS, FAR_TOKENS, GEOMETRIES, predicted_rows

    rows = predicted_rows()
    assert len(rows) == len(GEOMETRIES) * 2 * len(FAR_TOKENS) * len(FAR_CPS)
    assert all(r["seconds"][r["choice"]] is not None for r in rows)
    big = [r for r in rows if r["model"] == "Qwen3.5-397B-A17B" and r["cp"] == 128]
    assert big and all(r["seconds"]["ulysses"] is None for r in big)  # 64 value heads
    assert all(
        r["seconds"]["ulysses"] is not None
        for r in rows
        if r["model"] == "Qwen3.5-397B-A17B" and r["cp"] <= 64
    )
    # the CP state per rank: all_gather's grows with cp, scan's does not; a layer's step falls with cp
    for model in GEOMETRIES:
        line = sorted((r for r in rows if (r["model"], r["device"], r["seq_len"]) == (model, "gpu", 1 << 20)),
                      key=lambda r: r["cp"])  # fmt: skip
        gathered = [r["state_bytes"]["all_gather"] for r in line]
        assert gathered == sorted(gathered) and gathered[-1] == gathered[0] * FAR_CPS[-1] / FAR_CPS[0]
        assert len({r["state_bytes"]["scan"] for r in line}) == 1
        steps = [r["layer_seconds"] for r in line]
        assert steps == sorted(steps, reverse=True), steps
    panels = bench_scale.where_each_mode_wins(rows)
    assert len(panels) == 4 and all(list(p.points) == list(panels[0].points) for p in panels)
    save_png(tmp_path / "scale.png", panels)
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_split_rows_and_their_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_scale's (ep, cp, tp) part at one point per model and machine: every (tp, cp) of the
    devices listed, each ep dividing cp and the experts, the best one first, its mode the
    planner's choice at that tp and cp, and the map of the best tp drawn."""
    import bench_scale

    from benchkit import splits
    from benchkit.output import save_png
    from hyperpar_gdn import plan_context_parallel
    from hyperpar_gdn.planning.memory import ModelShape

    monkeypatch.setattr(splits, "SPLIT_TOKENS", (1 << 18,))
    monkeypatch.setattr(splits, "SPLIT_DEVICES", (16,))
    rows = splits.split_rows()
    assert len(rows) == len(splits.MODELS) * len(splits.BUDGET_GIB)
    for r in rows:
        shape = ModelShape.of(splits.MODELS[r["model"]])
        assert sorted({(s["tp"], s["cp"]) for s in r["ranking"]}) == [(t, 16 // t) for t in (1, 2, 4, 8, 16)]
        experts = shape.num_experts or 1
        assert all(s["cp"] % s["ep"] == 0 and experts % s["ep"] == 0 for s in r["ranking"])
        first = r["ranking"][0]
        assert (first["ep"], first["tp"], first["cp"], first["mode"]) == tuple(r["best"].values())
        plan = plan_context_parallel(
            seq_len=1 << 18, cp=first["cp"], tp=first["tp"], device=r["device"],
            inner_size=first["inner_size"] if first["inner_size"] else None,
            num_k_heads=shape.linear_num_key_heads, num_v_heads=shape.linear_num_value_heads,
            head_k_dim=128, head_v_dim=128, hidden_size=shape.hidden_size, num_experts=shape.num_experts,
        )  # fmt: skip
        assert plan.choice == first["mode"]
    panels = bench_scale.best_split_map(rows)
    assert len(panels) == 2 * len(splits.MODELS)
    save_png(tmp_path / "splits.png", panels)
    assert (tmp_path / "splits.png").stat().st_size > 5_000
