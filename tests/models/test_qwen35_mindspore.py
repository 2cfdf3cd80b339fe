"""The MindSpore Qwen3.5 model (dense and MoE) from tiny random transformers directories written by
transformers in the test: logits equal transformers' (fp32), ``save_pretrained`` writes the very
weights back and transformers loads them; multimodal and bfloat16 checkpoints; refused configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402
from tiny_models import move_off_init  # noqa: E402

from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM, Qwen35Config  # noqa: E402
from hyperpar_gdn.models.safetensors_files import read_weights  # noqa: E402

# Relative to the largest logit. docs/maths.md's fp32 bound is 1e-4; measured 1.1e-5 to 1.2e-5 (two
# frameworks' fp32 kernels through 4 blocks).
LOGIT_TOL = 1e-4
KINDS = ("dense", "dense-tied-bf16", "moe")


pytestmark = pytest.mark.usefixtures("mindspore_pynative")


def tiny_transformers_model(kind: str, *, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers Qwen3.5 causal LM of ``kind`` with every parameter moved off its init
    (zero-centred norms start at 0, which would hide a norm written as ``w * x``). Not
    ``tiny_models.tiny_config``: rope theta 500, a shared expert of 20 (the experts' 24), a tied
    bf16 variant and transformers' default experts implementation make another configuration."""
    common = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        tie_word_embeddings=kind == "dense-tied-bf16",
    )
    if kind != "dense-tied-bf16":  # the other one keeps transformers' default factor 0.25
        common["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.5,
        }
    torch.manual_seed(seed)
    if kind == "moe":
        config = transformers.Qwen3_5MoeTextConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=20,
        )
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**common, intermediate_size=48)
        )
    move_off_init(model, 0.1)
    return model.eval()


def write_model_dir(kind: str, out: Path) -> Path:
    model = tiny_transformers_model(kind)
    if kind == "dense-tied-bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(request.param, tmp_path_factory.mktemp(request.param))


def transformers_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


def _ids() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 97, (2, 37)).astype(np.int64)


def _rel(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def test_logits_equal_transformers(model_dir: Path) -> None:
    ids = _ids()
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir)
    logits = model(ms.Tensor(ids)).asnumpy()
    reference = transformers_logits(model_dir, ids)
    assert logits.shape == reference.shape == (2, 37, 97)
    error = _rel(logits, reference)
    assert error <= LOGIT_TOL, f"{model_dir.name}: relative logit error {error:.3g}"


def test_save_pretrained_round_trip(model_dir: Path, tmp_path: Path) -> None:
    """The saved file holds exactly the checkpoint's tensors (as float32) and transformers loads it
    to the same logits as the original directory."""
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir)
    out = model.save_pretrained(tmp_path / "saved")
    original, saved = read_weights(model_dir), load_file(str(out / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name, array in original.items():
        assert saved[name].dtype == np.float32
        np.testing.assert_array_equal(saved[name], array.astype(np.float32), err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [
        "Qwen3_5MoeForCausalLM" if model.config.num_experts else "Qwen3_5ForCausalLM"
    ]
    ids = _ids()
    error = _rel(transformers_logits(out, ids), transformers_logits(model_dir, ids))
    assert error <= 1e-6, error


def test_save_pretrained_replaces_a_directory_only_when_whole(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that fails after its weights are written leaves the earlier directory as it was and
    nothing beside it; the next save replaces it."""
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir)
    out = model.save_pretrained(tmp_path / "saved")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(Path, "write_text", _disk_full)  # config.json, after model.safetensors
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    (out / "model.safetensors").write_bytes(b"stale")
    model.save_pretrained(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


def test_parameter_names_are_transformers(model_dir: Path) -> None:
    names = {name for name, _ in Qwen3_5ForCausalLM.from_pretrained(model_dir).parameters_and_names()}
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = set(read_weights(model_dir))
    assert names == expected
    assert ("lm_head.weight" in names) == (not reference.config.tie_word_embeddings)
    assert {
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.3.self_attn.q_proj.weight",
    } <= names


def test_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """A ``qwen3_5`` directory: config under ``text_config``, weights under
    ``model.language_model.``; the vision tower's and the MTP head's entries are skipped."""
    text_dir = write_model_dir("dense", tmp_path / "text")
    text_config = json.loads((text_dir / "config.json").read_text())
    multi = tmp_path / "multimodal"
    multi.mkdir()
    config = {"model_type": "qwen3_5", "text_config": text_config, "vision_config": {"depth": 1}}
    (multi / "config.json").write_text(json.dumps(config))
    weights = {
        (name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name): array
        for name, array in load_file(str(text_dir / "model.safetensors")).items()
    }
    weights["model.visual.patch_embed.proj.weight"] = np.zeros((2, 3), np.float32)
    weights["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    save_file(weights, str(multi / "model.safetensors"), metadata={"format": "pt"})
    ids = _ids()
    logits = Qwen3_5ForCausalLM.from_pretrained(multi)(ms.Tensor(ids)).asnumpy()
    assert _rel(logits, transformers_logits(text_dir, ids)) <= LOGIT_TOL


def test_a_missing_or_unknown_weight_is_named(tmp_path: Path) -> None:
    path = write_model_dir("dense", tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.9.mlp.up_proj.weight"] = weights.pop("model.layers.3.self_attn.q_norm.weight")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"lacks \['model\.layers\.3\.self_attn\.q_norm\.weight'\].*lacks \['model\.layers\.9",
    ):
        Qwen3_5ForCausalLM.from_pretrained(path)


def _text_config() -> dict[str, Any]:
    return tiny_transformers_model("dense").config.to_dict()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("attention_bias", True, "attention_bias=True is not implemented"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, "rope_type='yarn'"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("attention_dropout", 0.1, "attention_dropout=0.1"),
    ],
    ids=["attention_bias", "rope_type", "hidden_act", "dropout"],
)
def test_unimplemented_config_fields_are_refused(field: str, value: Any, message: str) -> None:
    config = {**_text_config(), field: value}
    with pytest.raises(NotImplementedError, match=message):
        Qwen35Config.from_dict(config)


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="model_type 'llama' is not a Qwen3.5 model"):
        Qwen35Config.from_dict({**_text_config(), "model_type": "llama"})
    with pytest.raises(ValueError, match="layer_types .* must be 4"):
        Qwen35Config.from_dict({**_text_config(), "layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="hidden_size must be a positive int; got 0"):
        Qwen35Config.from_dict({**_text_config(), "hidden_size": 0})
