"""What a user sees after a mistake, for scripts/generate.py, train.py and selfcheck.py: one line on rank
0 (``<script>: error: ...`` naming the value and the rule), no traceback from this project on any
rank, every rank ends; exit code 2 from ``python``, torchrun's 1 under torchrun (with the line as
its failure summary's root cause). Also: every option of every script has a help text and shows
its default."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from distributed_harness import ROOT, run_script, script_command

SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny model directory, a prompt, an empty prompt and a checkpoint directory."""
    tmp = tmp_path_factory.mktemp("user_errors")
    command = script_command("scripts/make_tiny_qwen35.py", str(tmp / "tiny"), ranks=0)
    subprocess.run(command, check=True, capture_output=True, timeout=300, env=_env())
    (tmp / "prompt.txt").write_text("The mill wheel turns all day long.")
    (tmp / "empty.txt").write_text("\n")
    (tmp / "ckpt" / "step-2").mkdir(parents=True)
    (tmp / "ckpt" / "step-2" / "manifest.json").write_text("{}")
    return tmp


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HP_PLATFORM", None)
    return {**env, **extra}


GEN = ["--model", "tiny", "--prompt-file", "prompt.txt"]
# id: (script, ranks (0: plain python), arguments, environment, the line's expected text)
CASES = {
    "gen-empty-prompt": (
        "generate.py",
        0,
        ["--model", "tiny", "--prompt-file", "empty.txt"],
        {},
        "--prompt-file empty.txt is empty",
    ),
    "gen-missing-prompt": (
        "generate.py",
        0,
        ["--model", "tiny", "--prompt-file", "nope.txt"],
        {},
        "--prompt-file nope.txt: no such file",
    ),
    "gen-missing-model": (
        "generate.py",
        0,
        ["--model", "nodir", "--prompt-file", "prompt.txt"],
        {},
        "--model nodir: no such directory",
    ),
    "gen-checkpoint-as-model": (
        "generate.py",
        0,
        ["--model", "ckpt/step-2", "--prompt-file", "prompt.txt"],
        {},
        "--model ckpt/step-2 is a training checkpoint (train.py --save)",
    ),
    "gen-sampling-without-sample": (
        "generate.py",
        0,
        [*GEN, "--temperature", "5.0", "--top-k", "3", "--seed", "7"],
        {},
        "--temperature 5.0 --top-k 3 --seed 7 only apply to sampling; add --sample",
    ),
    "gen-cuda-without-cuda": (
        "generate.py",
        0,
        [*GEN, "--device", "cuda"],
        {},
        "platform 'cuda' (HP_PLATFORM=cuda or device 'cuda') needs a CUDA device",
    ),
    "gen-zero-tokens-2ranks": (
        "generate.py",
        2,
        [*GEN, "--max-new-tokens", "0"],
        {},
        "--max-new-tokens must be at least 1; got 0",
    ),
    "gen-ulysses-heads-3ranks": (
        "generate.py",
        3,
        [*GEN, "--cp-mode", "ulysses"],
        {},
        "--cp-mode ulysses splits the GDN heads over cp=3 ranks, but tiny has 2 key and 4 value heads",
    ),
    "gen-prompt-beyond-positions-2ranks": (
        "generate.py",
        2,
        [*GEN, "--min-prompt-tokens", "4097"],
        {},
        "the prompt has T=4097 tokens (--min-prompt-tokens 4097), more than the position range of tiny: "
        "max_position_embeddings=4096",
    ),
    "selfcheck-seq-len-2ranks": (
        "selfcheck.py",
        2,
        ["--seq-len", "7"],
        {"HP_PLATFORM": "cpu"},
        "--seq-len 7 must be divisible by the 2 ranks",
    ),
    "train-cuda-without-cuda-2ranks": (
        "train.py",
        2,
        ["--steps", "1"],
        {"HP_PLATFORM": "cuda"},
        "platform 'cuda' (HP_PLATFORM=cuda or device 'cuda') needs a CUDA device",
    ),
}


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the CUDA cases need a machine without CUDA"
)
@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line(case: str, work: Path) -> None:
    script, ranks, args, env, expected = CASES[case]
    if env.get("HP_PLATFORM") == "mindspore":
        pytest.importorskip("mindspore")
    result = run_script(f"scripts/{script}", *args, ranks=ranks, cwd=work, env=_env(**env), timeout=120)
    out = result.stdout + result.stderr
    ours = [line for line in out.splitlines() if line.startswith(f"{script}: error:")]
    assert len(ours) == 1, out  # rank 0 only, once
    assert expected in ours[0], ours[0]
    assert result.returncode == (1 if ranks else 2), out
    # no traceback of ours (its frames name our files; a message may name a module to use)
    assert "hyperpar_gdn/" not in out and f'{script}", line' not in out, out
    if ranks:  # torchrun's summary names our line as the root cause, and every rank ended: with our
        # code 2, or stopped by torchrun once another rank failed first (SIGTERM: -15, or 143 when
        # the process exits from a handler)
        assert f"traceback : {ours[0]}" in out, out
        assert len(re.findall(r"exitcode +: (?:2|-15|143) ", out)) == ranks, out


def _options(help_text: str) -> dict[str, str]:
    """Each option of an argparse help text -> its help paragraph on one line."""
    paragraphs: dict[str, str] = {}
    current = None
    for line in help_text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            paragraphs[current] = line.strip()
        elif current is not None and line.strip():
            paragraphs[current] += " " + line.strip()
    return paragraphs


def test_every_option_of_every_script_has_help_and_default() -> None:
    """``--help`` of every script: each option has a description; each that takes a value says
    its default (argparse's ``(default: X)`` or the help's own words)."""
    procs = {
        name: subprocess.Popen(
            script_command(f"scripts/{name}", "--help", ranks=0),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in SCRIPTS
    }
    missing = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}: {err}"
        options = _options(out)
        assert len(options) > 1, f"{name}: {out}"
        for option, paragraph in options.items():
            if option in ("-h", "--help"):
                continue
            words = paragraph.split()
            takes_value = (
                len(words) > 1
                and words[1].isupper()
                or "{" in words[0]
                or (len(words) > 1 and words[1].startswith("{"))
            )
            described = len(words) > (3 if takes_value else 2)
            if not described or (takes_value and "default" not in paragraph and "required" not in paragraph):
                missing.append(f"{name} {paragraph}")
    assert not missing, "\n".join(missing)
