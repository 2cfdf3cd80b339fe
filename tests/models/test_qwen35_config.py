"""A model directory's config.json has one reader: the MindSpore model's config and the trainer's
``--model`` checks get the same dict and the same errors (the latter naming the option)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperpar_gdn.integrations.transformers import model_config
from hyperpar_gdn.models.qwen35_config import Qwen35Config, read_config


def _text() -> dict[str, object]:
    return {
        "model_type": "qwen3_5_text", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
    }  # fmt: skip


def test_both_readers_read_the_same_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": _text()}))
    assert read_config(tmp_path) == model_config.read_config(tmp_path)
    assert model_config.text_config(tmp_path) == _text()
    assert Qwen35Config.from_pretrained(tmp_path).model_type == "qwen3_5_text"


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (None, FileNotFoundError, "no config.json there"),
        ("{", ValueError, "config.json is not valid JSON"),
        (
            '{"model_type": "llama"}',
            ValueError,
            "model_type 'llama' is not a Qwen3.5 model; supported: qwen3_5_text",
        ),
    ],
    ids=["missing", "not-json", "not-qwen35"],
)
def test_both_readers_refuse_with_the_same_line(
    tmp_path: Path, content: str | None, error: type[Exception], message: str
) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(error, match=f"^{tmp_path}: {message}"):
        Qwen35Config.from_pretrained(tmp_path)
    with pytest.raises(error, match=f"^--model {tmp_path}: {message}"):
        model_config.read_config(tmp_path)
