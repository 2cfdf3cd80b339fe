"""Training a transformers Qwen3.5 model directory under context parallelism (real gloo ranks):
the loss falls and follows the run without CP; the exported directory loads in transformers and
gives the trained model's logits; --data formats are tokenized with the directory's tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import undo_context_parallel
from hyperpar_gdn.integrations.transformers.model_dir import load_model_dir
from hyperpar_gdn.train import TrainConfig, Trainer
from hyperpar_gdn.train.data.global_batches import load_tokens, read_documents

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
PARITY_TOL = 1e-4  # fp32, per step


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model directory written by scripts/make_tiny_qwen35.py, as a user would."""
    out = tmp_path_factory.mktemp("model") / ("moe" if request.param else "dense")
    command = [sys.executable, str(ROOT / "scripts" / "make_tiny_qwen35.py"), str(out)]
    subprocess.run(
        command + (["--moe"] if request.param else []), check=True, capture_output=True, timeout=120
    )
    return out


def _train_and_export(rank: int, world: int, options: dict[str, Any], probe: torch.Tensor) -> dict[str, Any]:
    trainer = Trainer(TrainConfig(**options))
    try:
        result = trainer.train()
        logits = None
        if rank == 0:  # the trained model itself, on one device
            model = undo_context_parallel(trainer.model) if world > 1 else trainer.model
            with torch.no_grad():
                logits = model.eval()(input_ids=probe, use_cache=False).logits
    finally:
        trainer.close()
    return {
        "losses": result.losses,
        "reference": [r.reference_loss for r in result.records],
        "logits": logits,
    }


def test_train_export_reload(model_dir: Path, tmp_path: Path) -> None:
    export = tmp_path / "trained"
    options = {
        "model_dir": str(model_dir),
        "export": str(export),
        "cp_mode": "all_gather",
        "seq_len": 64,
        "batch_size": 4,
        "steps": STEPS,
        "lr": 3e-3,
        "check_parity": True,
    }
    probe = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    rank0, _ = run_ranks(_train_and_export, 2, options, probe, timeout_s=240)
    losses, reference = rank0["losses"], rank0["reference"]
    assert max(losses[-3:]) < losses[0] - 1.0, losses
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= PARITY_TOL

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=probe, use_cache=False).logits
    torch.testing.assert_close(logits, rank0["logits"], rtol=0, atol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        assert (original(input_ids=probe, use_cache=False).logits - logits).abs().max() > 1e-2  # it trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert (
        tokenizer("The river runs")["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(model_dir)("The river runs")["input_ids"]
    )


def test_data_formats(model_dir: Path, tmp_path: Path) -> None:
    _, tokenizer = load_model_dir(model_dir)
    eos = tokenizer.eos_token_id
    (tmp_path / "a.txt").write_text("The miller opens the gate.")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "The baker bakes."}) + "\n\n" + json.dumps({"text": "Dogs sleep."}) + "\n"
    )
    assert read_documents(str(tmp_path)) == ["The miller opens the gate.", "The baker bakes.", "Dogs sleep."]
    tokens = load_tokens(str(tmp_path), tokenizer).tolist()
    expected = []
    for doc in ("The miller opens the gate.", "The baker bakes.", "Dogs sleep."):
        expected += tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]
    assert tokens == expected
    # byte tokens for the built-in model: JSONL documents joined by a newline
    assert bytes(load_tokens(str(tmp_path / "b.jsonl")).tolist()) == b"The baker bakes.\nDogs sleep."


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json\n", r"b.jsonl:1: not JSON"),
        ('{"txt": "x"}\n', r'b.jsonl:1: expected an object with a "text" string'),
    ],
)
def test_bad_jsonl(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_documents(str(tmp_path / "b.jsonl"))


def test_bad_directory(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"x.bin is not a text"):
        read_documents(str(tmp_path))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"model_dir": "m", "model_size": "small"}, r"--model-size small sizes the built-in model"),
        ({"export": "out"}, r"--export out writes a transformers directory; it needs --model DIR"),
    ],
)
def test_option_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)


def test_not_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        TrainConfig(model_dir=str(tmp_path)).mesh_shape(2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not a Qwen3.5 model"):
        TrainConfig(model_dir=str(tmp_path)).mesh_shape(2)


def _straight_then_resumed(rank: int, world: int, options: dict[str, Any], root: str) -> list[list[float]]:
    save = str(Path(root) / "ckpt")
    straight = _train_and_export(
        rank, world, {**options, "save": save, "save_every": 5}, torch.zeros(1, 1, dtype=torch.int64)
    )
    resumed = _train_and_export(
        rank, world, {**options, "resume": save + "/step-5"}, torch.zeros(1, 1, dtype=torch.int64)
    )
    return [straight["losses"], resumed["losses"]]


def test_save_and_resume(model_dir: Path, tmp_path: Path) -> None:
    options = {"model_dir": str(model_dir), "cp_mode": "p2p", "seq_len": 64, "batch_size": 4, "steps": 10}
    straight, resumed = run_ranks(_straight_then_resumed, 2, options, str(tmp_path), timeout_s=240)[0]
    assert resumed == straight[5:]  # the very same steps 6..10
