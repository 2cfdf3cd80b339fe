"""scripts/bench_ops.py's MindSpore/torch report (issue 11): the ratios it computes from the
alternated timings, and the default T of each backend. No timing here. (``scripts/`` is on
``sys.path`` under pytest, see pyproject.toml.)"""

from __future__ import annotations

import bench_ops
import pytest


def test_mindspore_over_torch_ratios() -> None:
    samples = {
        "ours/forward": [2.0, 4.0, 3.0],
        "ours_torch/forward": [1.0, 1.0, 2.0],
        "ours/forward_backward": [6.0, 5.0, 9.0],
        "ours_torch/forward_backward": [2.0, 2.0, 3.0],
    }
    report = bench_ops.mindspore_over_torch(samples)
    fwd, fwd_bwd = report["forward"], report["forward_backward"]
    assert fwd["ratio_of_medians"] == pytest.approx(3.0 / 1.0)
    assert fwd["round_ratios"] == pytest.approx([2.0, 4.0, 1.5])
    assert fwd["median_of_round_ratios"] == pytest.approx(2.0)
    assert fwd["ratio_of_minima"] == pytest.approx(2.0 / 1.0)
    assert fwd_bwd["ratio_of_medians"] == pytest.approx(6.0 / 2.0)
    assert fwd_bwd["median_of_round_ratios"] == pytest.approx(3.0)
    assert report["target"] == 2.5 and report["within_target"] is False
    samples["ours/forward_backward"] = [4.0, 5.0, 6.0]  # 5 / 2 = 2.5: on the target
    assert bench_ops.mindspore_over_torch(samples)["within_target"] is True


@pytest.mark.parametrize(("argv", "seq_len"), [([], 4096), (["--backend", "mindspore"], 2048)])
def test_default_seq_len_per_backend(argv: list[str], seq_len: int) -> None:
    cfg, _, _ = bench_ops.parse_args(argv)
    assert cfg.T == seq_len
    assert bench_ops.parse_args([*argv, "--T", "300"])[0].T == 300
