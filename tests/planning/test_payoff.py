"""The CP pay-off note: priced by the cost model with the machine's figures (the device kind's, or
the caller's), per sequence; read from HybridLM's and transformers' config dicts alike."""

from __future__ import annotations

import pytest

from hyperpar_gdn.models.config import HybridLMConfig
from hyperpar_gdn.planning.cost_model import MACHINES, Geometry, mode_cost
from hyperpar_gdn.planning.payoff import cp_advice, cp_payoff

CONFIG = HybridLMConfig().to_dict()  # 2 key / 4 value heads of 16, conv 4, hidden 64


def test_the_verdict_is_the_cost_models() -> None:
    payoff = cp_payoff(model_config=CONFIG, seq_len=256, cp=2, mode="p2p", layout="head_tail", device="cpu")
    geometry = Geometry(256, 2, 2, 4, 16, 16, 4, 1, 4, head_tail=True, hidden=64)
    cost = mode_cost("p2p", geometry, MACHINES["cpu"])
    assert payoff.added_s == pytest.approx(cost.seconds)
    assert payoff.saved_s == pytest.approx(cost.shared_seconds)  # cp=2: one shard's work split off
    assert payoff.speedup == pytest.approx(2 * cost.shared_seconds / (cost.shared_seconds + cost.seconds))
    # the break-even is the first doubling of T at which the split-off work exceeds the exchanges
    t = payoff.break_even
    longer = mode_cost(
        "p2p", Geometry(t, 2, 2, 4, 16, 16, 4, 1, 4, head_tail=True, hidden=64), MACHINES["cpu"]
    )
    shorter = mode_cost(
        "p2p", Geometry(t // 2, 2, 2, 4, 16, 16, 4, 1, 4, head_tail=True, hidden=64), MACHINES["cpu"]
    )
    assert longer.shared_seconds > longer.seconds and shorter.shared_seconds <= shorter.seconds


def test_configured_figures_replace_the_device_kinds() -> None:
    note = cp_advice(
        model_config={"text_config": CONFIG},  # a multimodal transformers config nests its text part
        seq_len=128, cp=2, mode="ulysses", layout="contiguous", device="cpu", fewer="one process",
    )  # fmt: skip
    assert note is not None and "per sequence" in note and "tokens per rank" not in note
    assert "(cpu: 2.2 GB/s, 360 us per message, 18 GFLOP/s)" in note and note.endswith(
        "faster here: one process"
    )
    fast_links = dict(bandwidth=1e15, latency=0.0)
    assert cp_advice(
        model_config=CONFIG, seq_len=128, cp=2, mode="ulysses", layout="contiguous", device="cpu",
        fewer="one process", **fast_links,
    ) is None  # fmt: skip
    assert cp_advice(model_config=CONFIG, seq_len=128, cp=1, mode="p2p", layout="contiguous", device="cpu",
                     fewer="-") is None  # fmt: skip


def test_a_config_without_gdn_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match="no linear_num_key_heads"):
        cp_payoff(model_config={"hidden_size": 64}, seq_len=128, cp=2, mode="p2p", layout="contiguous",
                  device="cpu")  # fmt: skip


def test_the_readme_names_the_first_runs_break_even() -> None:
    """README.md's first run: the length from which the cost model expects a gain is the one its
    header's note gives (the default run's model, mode, layout and length)."""
    import re
    from pathlib import Path

    from hyperpar_gdn.train.config import TrainConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    said = re.search(r"\(about ([\d,]+) tokens per sequence for this model", readme)
    assert said, "README.md no longer says where the first run's CP starts to pay"
    config = TrainConfig()
    payoff = cp_payoff(
        model_config=config.model.to_dict(), seq_len=config.seq_len, cp=2, mode=config.cp_mode,
        layout=config.token_layout(), device="cpu",
    )  # fmt: skip
    assert payoff.speedup < 1 and int(said[1].replace(",", "")) == payoff.break_even
