"""What a user of scripts/train.py and scripts/selfcheck.py reads: --help shows the real defaults
and both scripts name their options alike; the run header lists --fsdp and --ac; a resumed run
with changed options warns once (rank 0), not once per rank."""

from __future__ import annotations

from pathlib import Path

from distributed_harness import ROOT, run_script

from hyperpar_gdn.planning.plan import MODES
from hyperpar_gdn.train.command_line import build_parser


def _help_of(option: str, text: str) -> str:
    """The help paragraph of ``option`` in an argparse help text, on one line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {option}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")), len(lines))
    return " ".join(line.strip() for line in lines[start:end])


def test_train_help_shows_the_real_defaults() -> None:
    text = build_parser().format_help()
    assert "default: off, documents restart" in _help_of("--no-doc-boundaries", text)
    assert "(default: True)" not in text and "(default: None)" not in text
    assert "default: tiny; not with --model" in _help_of("--model-size", text)
    assert "default: all ranks" in _help_of("--cp-size", text)
    assert "(default: 600.0)" in _help_of("--timeout-s", text)


def test_selfcheck_options_have_help_and_train_names() -> None:
    result = run_script("scripts/selfcheck.py", "--help", ranks=0, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--seq-len", "--batch-size", "--seed", "--timeout-s", "--hidden", "--v-heads"):
        paragraph = _help_of(option, result.stdout)
        assert "(default: " in paragraph and len(paragraph.split()) > 4, paragraph
    assert "--timeout " not in result.stdout and "--batch " not in result.stdout


def _torchrun(tmp: Path, *args: str) -> str:
    result = run_script(
        "scripts/train.py", "--seq-len", "32", "--batch-size", "2", *args, cwd=tmp, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_header_and_resume_warning(tmp_path: Path) -> None:
    first = _torchrun(tmp_path, "--steps", "2", "--fsdp", "--ac", "--save", "ckpt")
    assert "(--cp-mode ulysses, --cp-layout head_tail, --fsdp, --ac)" in first, first
    assert "--dtype fp32" in first, first
    resumed = _torchrun(tmp_path, "--steps", "3", "--lr", "0.002", "--resume", "ckpt")
    assert "(--cp-mode ulysses, --cp-layout head_tail)" in resumed, resumed
    assert resumed.count("resuming with changed options") == 1, resumed
    assert "--lr 0.001 (now 0.002)" in resumed


def test_header_says_which_mode_auto_chose_and_why(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, "--steps", "1", "--cp-mode", "auto")
    header = next(line for line in out.splitlines() if "ranks = dp" in line)
    chosen = header.split("(--cp-mode auto: ")[1].split(",")[0]
    assert chosen in MODES, header
    (line,) = [line for line in out.splitlines() if "--cp-mode auto chose" in line]
    assert f"--cp-mode auto chose {chosen}: predicted fastest for T=32, cp=2" in line, out
    assert len(line) < 180, line  # the whole ranking is plan_context_parallel's, not the log's
