"""scripts/generate.py on 2 gloo ranks with a model directory from scripts/make_tiny_qwen35.py, every
run in one launch: its greedy continuation equals transformers' one-device ``generate`` in every
mode (scan included) and layout (``--cp-layout``, and its default), decoding on one device and on the
CP group (with the K/V cache bytes per rank); the JSON holds the timings; sampling is reproducible
from its seed; scripts/plot_generate.py draws the JSON; bad options are refused. With ``--tp 2`` on
4 ranks (cp 2 x tp 2, the model split by heads) the continuation, on the first CP rank's TP group
and on every rank, equals ``generate`` too."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.inference import generate_options, generate_run

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The river runs past the old mill, and the mill wheel turns all day long."


def load_script() -> Any:
    """scripts/generate.py as a module (its ``main``)."""
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


def _run_each(rank: int, world: int, argvs: list[list[str]]) -> list[int]:
    """generate.py's ``main`` for each command line in turn, in one process group (one launch)."""
    script = load_script()
    return [script.main(argv) for argv in argvs]


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def _repeated(ids: list[int], t: int) -> list[int]:
    """The prompt's tokens repeated up to ``t`` (what ``--min-prompt-tokens t`` reads)."""
    return (ids * (t // len(ids) + 1))[:t]


def _runs(even: int) -> dict[str, list[str]]:
    """The command lines of the shared job (``even``: a prompt length divisible by 2cp = 4; the
    greedy runs decode 16 tokens, the sampling runs 12)."""
    greedy = ["--max-new-tokens", "16"]
    sample = ["--sample", "--temperature", "2.0", "--max-new-tokens", "12"]
    return {
        # T odd: the default layout is contiguous
        "ulysses": ["--cp-mode", "ulysses", "--min-prompt-tokens", str(even + 1), *greedy, "--repeats", "2"]
        + ["--compare-one-device"],
        # T divisible by 2cp, attention layers: the default layout is head_tail
        # the earlier spelling of --cp-mode, still read
        "scan": ["--mode", "scan", "--min-prompt-tokens", str(even), *greedy],
        "auto": ["--cp-mode", "auto", "--min-prompt-tokens", str(even), *greedy],
        "all_gather": [
            "--cp-mode",
            "all_gather",
            "--cp-layout",
            "contiguous",
            "--min-prompt-tokens",
            str(even),
        ]
        + greedy,
        "cp-group": ["--cp-layout", "head_tail", "--min-prompt-tokens", str(even), "--decode-on", "cp-group"]
        + greedy,
        "seed1": [*sample, "--seed", "1"],
        "seed1-again": [*sample, "--seed", "1"],
        "seed2": [*sample, "--seed", "2"],
    }


@pytest.fixture(scope="module")
def runs(model_dir: Path, prompt_ids: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of :func:`_runs` on 2 gloo ranks in one launch -> name: its ``--out`` JSON."""
    tmp = tmp_path_factory.mktemp("runs")
    prompt = tmp / "prompt.txt"
    prompt.write_text(PROMPT)
    runs = _runs(4 * (len(prompt_ids) // 4 + 1))
    argvs = [
        ["--model", str(model_dir), "--prompt-file", str(prompt), *argv, "--out", str(tmp / f"{name}.json")]
        for name, argv in runs.items()
    ]
    assert run_ranks(_run_each, 2, argvs, timeout_s=300) == [[0] * len(runs)] * 2
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in runs}


def _expected(model_dir: Path, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` on one device."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = torch.tensor([ids])
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    ("name", "mode", "layout"),
    [
        ("ulysses", "ulysses", "contiguous"),
        ("scan", "scan", "head_tail"),
        ("all_gather", "all_gather", "contiguous"),
        ("cp-group", "p2p", "head_tail"),
    ],
)
def test_greedy_continuation_equals_transformers(
    runs: dict[str, Any], model_dir: Path, prompt_ids: list[int], name: str, mode: str, layout: str
) -> None:
    """Every mode and layout (``--cp-layout``, or its default from T) continues the prompt (repeated
    up to ``--min-prompt-tokens``) as transformers' ``generate`` does."""
    result = runs[name]
    t = result["prompt_tokens"]
    assert result["new_tokens"] == _expected(model_dir, _repeated(prompt_ids, t), 16)
    assert (result["mode"], result["layout"], result["cp"]) == (mode, layout, 2)
    assert result["framework"] == "torch" and result["device"] == "cpu"
    assert len(result["prefill_s"]) == (2 if name == "ulysses" else 1)
    assert result["prefill_tokens_per_s"] == pytest.approx(t / statistics.median(result["prefill_s"]))
    steps = result["decode_tokens_per_s"] * result["decode_s_per_token"]
    assert steps == pytest.approx(1.0) and len(result["loadavg"]) == 3
    if name == "ulysses":  # --compare-one-device: both one-device paths in each round
        assert len(result["one_device_prefill_s"]) == len(result["cp1_prefill_s"]) == 2
    else:
        assert result["one_device_prefill_s"] is None and result["cp1_prefill_s"] is None


def test_decoding_on_the_cp_group_keeps_the_cache_sharded(runs: dict[str, Any]) -> None:
    """--decode-on cp-group (after a head_tail prefill): every rank keeps its share of the attention
    K/V (within one token of the others; together the prompt and the 15 appended tokens)."""
    result = runs["cp-group"]
    assert result["decode_on"] == "cp-group" and runs["scan"]["decode_on"] == "one-device"
    t, per_rank = result["prompt_tokens"], result["kv_cache_bytes_per_rank"]
    per_token = result["kv_cache_bytes_one_device"] // t
    assert per_token * t == result["kv_cache_bytes_one_device"]
    assert sum(per_rank) == per_token * (t + 15) and max(per_rank) - min(per_rank) <= per_token


def test_sampling_follows_the_seed(runs: dict[str, Any]) -> None:
    assert runs["seed1"]["new_tokens"] == runs["seed1-again"]["new_tokens"] != runs["seed2"]["new_tokens"]
    assert len(runs["seed1"]["new_tokens"]) == 12


def test_plot_draws_every_run(runs: dict[str, Any], tmp_path: Path) -> None:
    """scripts/plot_generate.py: a bar per run and path, the medians of the JSON; a PNG."""
    import plot_generate

    files = []
    for name in ("ulysses", "cp-group"):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(runs[name]))
    prefill, kv, decoding = plot_generate.panels([runs["ulysses"], runs["cp-group"]])
    one = runs["ulysses"]
    label = f"ulysses contiguous T={one['prompt_tokens']}"
    assert prefill.bars[f"{label}\ncp=2"][0] == statistics.median(one["prefill_s"])
    assert prefill.bars[f"{label}\ntransformers"][0] == statistics.median(one["one_device_prefill_s"])
    assert prefill.bars[f"{label}\ncp=1"][0] == statistics.median(one["cp1_prefill_s"])
    assert len(prefill.bars) == 4 and len(kv.bars) == 3 and len(decoding.bars) == 2
    sharded = runs["cp-group"]["kv_cache_bytes_per_rank"]
    assert sorted(h for name, (h, _) in kv.bars.items() if "rank" in name) == sorted(
        b / 2**20 for b in sharded
    )
    out = tmp_path / "plot.png"
    assert plot_generate.main([*map(str, files), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_generate.main([str(tmp_path / "nope.json"), "--out", str(out)]) == 2
    files[0].write_text(json.dumps({"mode": "p2p"}))
    with pytest.raises(ValueError, match=r"is not a generate.py result: it lacks framework, layout, cp"):
        plot_generate.load_result(files[0])


def test_head_tail_needs_2cp_pieces(model_dir: Path, tmp_path: Path) -> None:
    """--layout head_tail with T not divisible by 2cp: one error naming T and the way out (raised by
    every rank alike, before any communication); a prompt beyond the position range likewise."""
    script = generate_options
    args = script.parse_args(["--model", str(model_dir), "--prompt-file", "p", "--cp-layout", "head_tail"])
    assert script.token_layout(args, 12, 2) == "head_tail"
    with pytest.raises(
        ValueError, match=re.escape("--cp-layout head_tail cuts the prompt's T=10 tokens into 2 x cp")
    ):
        script.token_layout(args, 10, 2)
    args.cp_layout = None  # the default: head_tail when T divides (the tiny model has attention layers)
    cases = ((12, 2), (10, 2), (12, 1), (8, 2))  # T=8: pieces of 2 tokens, under the conv halo of 3
    assert [script.token_layout(args, t, cp) for t, cp in cases] == ["head_tail"] + ["contiguous"] * 3
    script.check_prompt_length(args, 4096)
    with pytest.raises(ValueError, match=re.escape("max_position_embeddings=4096")):
        script.check_prompt_length(args, 4097)


def test_tp2_continuation_equals_transformers(model_dir: Path, prompt_ids: list[int], tmp_path: Path) -> None:
    """--tp 2 on 4 ranks: a p2p prefill at cp 2 on each TP rank's heads, decoded on the first CP
    rank's TP group and (scan, head_tail) on every rank with the K/V sharded by tokens and heads."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    even = 4 * (len(prompt_ids) // 4 + 1)
    runs = {
        "one-device": ["--cp-layout", "contiguous"],
        "cp-group": ["--cp-mode", "scan", "--cp-layout", "head_tail", "--decode-on", "cp-group"],
    }
    common = ["--model", str(model_dir), "--prompt-file", str(prompt), "--tp", "2", "--max-new-tokens", "12"]
    argvs = [
        [*common, "--min-prompt-tokens", str(even), *argv, "--out", str(tmp_path / f"{name}.json")]
        for name, argv in runs.items()
    ]
    assert run_ranks(_run_each, 4, argvs, timeout_s=300) == [[0, 0]] * 4
    expected = _expected(model_dir, _repeated(prompt_ids, even), 12)
    for name in runs:
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["new_tokens"] == expected, name
        assert (result["cp"], result["tp"], result["decode_on"]) == (2, 2, name)
    result = json.loads((tmp_path / "cp-group.json").read_text())
    per_rank, one = result["kv_cache_bytes_per_rank"], result["kv_cache_bytes_one_device"]
    assert sum(per_rank) * 2 == one // even * (even + 11)  # each rank: its K/V heads (half) of its tokens


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1; got 0"),
        (["--tp", "2", "--compare-one-device"], "--compare-one-device times rank 0 alone; with --tp 2"),
        (["--sample", "--temperature", "0"], "--temperature=0.0 must be > 0"),
        (["--top-k", "3"], "--top-k 3 only apply to sampling; add --sample"),
        (["--cp-mode", "ulysses+p2p"], "--cp-mode ulysses+p2p requires --cp-inner-size N"),
        (["--cp-inner-size", "2"], "--cp-inner-size 2 goes with the two-level modes"),
        (["--mode", "p2p", "--cp-mode", "scan"], "--mode is the earlier name of --cp-mode: give one of them"),
        (["--layout", "zigzag"], "--layout (now --cp-layout) 'zigzag' is not one of contiguous, head_tail"),
    ],
)
def test_bad_options(option: list[str], message: str) -> None:
    from hyperpar_gdn.cli import UsageError

    with pytest.raises(UsageError, match=re.escape(message)):
        generate_options.parse_args(["--model", "m", "--prompt-file", "p", *option])


def test_the_builtin_prompt_and_whitespace_continuations() -> None:
    """Without --prompt-file the prompt is the built-in text's first paragraph; a continuation that
    decodes to whitespace (the tiny random model repeating a newline) shows its repr and token ids."""
    import argparse

    from hyperpar_gdn.corpus import BUILTIN_CORPUS

    args = generate_options.parse_args(["--model", "m"])
    assert args.prompt_file is None
    generate_options.check_paths(argparse.Namespace(model=ROOT, prompt_file=None))  # no prompt file to check
    text = generate_options.prompt_text(args)
    assert text.strip() and BUILTIN_CORPUS.startswith(text) and "\n\n" not in text
    assert generate_run.shown_text("the mill", [5, 6]) == "the mill"
    assert (
        generate_run.shown_text("\n\n ", [198, 198, 220])
        == "'\\n\\n ' (whitespace only; token ids [198, 198, 220])"
    )


def test_auto_runs_the_mode_the_cost_model_picks(
    runs: dict[str, Any], model_dir: Path, prompt_ids: list[int]
) -> None:
    from hyperpar_gdn.planning.plan import MODES

    result = runs["auto"]
    assert result["mode_asked"] == "auto" and result["mode"] in MODES, result
    assert result["new_tokens"] == _expected(model_dir, _repeated(prompt_ids, result["prompt_tokens"]), 16)


def test_the_earlier_option_names_still_work_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    """``--mode`` and ``--layout``, the names generate.py had, set --cp-mode and --cp-layout and
    say so in one line each."""
    args = generate_options.parse_args(["--model", "m", "--mode", "scan", "--layout", "contiguous"])
    assert (args.cp_mode, args.cp_layout) == ("scan", "contiguous")
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        "generate.py: note: --mode is now --cp-mode, as in train.py",
        "generate.py: note: --layout is now --cp-layout, as in train.py",
    ], notes
    args = generate_options.parse_args(["--model", "m", "--cp-mode", "ulysses+scan", "--cp-inner-size", "2"])
    assert (args.cp_mode, args.cp_inner_size) == ("ulysses+scan", 2)
    assert generate_options.parse_args(["--model", "m", "--cp-mode", "auto"]).cp_mode == "auto"
