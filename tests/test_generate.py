"""scripts/generate.py on 2 gloo ranks with a model directory from scripts/make_tiny_qwen35.py:
its greedy continuation equals transformers' one-device ``generate`` (decoding on one device and
on the CP group, with the K/V cache bytes per rank); the JSON holds the timings;
sampling is reproducible from its seed; bad options are refused."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The river runs past the old mill, and the mill wheel turns all day long."


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    command = [sys.executable, str(ROOT / "scripts" / "make_tiny_qwen35.py"), str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    with torch.no_grad():  # peaked logits: the tiny model's init gives near ties
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p, generator=None))
        model.save_pretrained(out)
    return out


def _run(rank: int, world: int, argv: list[str]) -> int:
    return load_script().main(argv)


def test_greedy_continuation_equals_transformers(model_dir: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    out = tmp_path / "result.json"
    argv = ["--model", str(model_dir), "--prompt-file", str(prompt), "--mode", "ulysses"]
    argv += ["--max-new-tokens", "16", "--repeats", "2", "--compare-one-device", "--out", str(out)]
    assert run_ranks(_run, 2, argv, timeout_s=240) == [0, 0]
    result = json.loads(out.read_text())
    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert result["new_tokens"] == expected
    assert result["prompt_tokens"] == ids.shape[1] and result["cp"] == 2
    assert result["framework"] == "torch" and result["device"] == "cpu"
    assert len(result["prefill_s"]) == 2 and len(result["one_device_prefill_s"]) == 2


def test_decoding_on_the_cp_group_equals_transformers(model_dir: Path, tmp_path: Path) -> None:
    """--decode-on cp-group: the same greedy tokens as transformers' generate, every rank keeping
    its share of the attention K/V (within one token of the others; together the prompt and the
    15 appended tokens)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    out = tmp_path / "result.json"
    argv = ["--model", str(model_dir), "--prompt-file", str(prompt), "--decode-on", "cp-group"]
    argv += ["--max-new-tokens", "16", "--out", str(out)]
    assert run_ranks(_run, 2, argv, timeout_s=240) == [0, 0]
    result = json.loads(out.read_text())
    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert result["new_tokens"] == expected and result["decode_on"] == "cp-group"
    t, per_rank = result["prompt_tokens"], result["kv_cache_bytes_per_rank"]
    per_token = result["kv_cache_bytes_one_device"] // t
    assert per_token * t == result["kv_cache_bytes_one_device"]
    assert sum(per_rank) == per_token * (t + 15) and max(per_rank) - min(per_rank) <= per_token


def test_sampling_follows_the_seed(model_dir: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    results = []
    for seed in (1, 1, 2):
        out = tmp_path / f"sample{len(results)}.json"
        argv = ["--model", str(model_dir), "--prompt-file", str(prompt), "--sample", "--temperature", "2.0"]
        argv += ["--max-new-tokens", "12", "--seed", str(seed), "--out", str(out)]
        run_ranks(_run, 2, argv, timeout_s=240)
        results.append(json.loads(out.read_text())["new_tokens"])
    assert results[0] == results[1] != results[2]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1; got 0"),
        (["--sample", "--temperature", "0"], "--temperature=0.0 must be > 0"),
        (["--top-k", "3"], "--top-k 3 only apply to sampling; add --sample"),
    ],
)
def test_bad_options(option: list[str], message: str) -> None:
    from hyperpar_gdn.cli import UsageError

    with pytest.raises(UsageError, match=re.escape(message)):
        load_script().parse_args(["--model", "m", "--prompt-file", "p", *option])
