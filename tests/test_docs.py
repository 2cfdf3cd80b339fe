"""The docs cannot drift: every fenced Python block of README.md and docs/*.md whose info string is
``python runnable`` runs here, in a fresh process (``python runnable ranks=N``: on N forked gloo
ranks, as ``torchrun --nproc-per-node N`` would run it), and must finish without an error; any
other Python block is marked ``python fragment``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distributed_harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```\s*$", re.MULTILINE | re.DOTALL)
RUNNABLE = re.compile(r"^python runnable(?: ranks=(?P<ranks>\d+))?$")


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(id ``file:line``, ranks, code) of every runnable block."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            info = match["info"].strip()
            if info.startswith("python runnable") and not RUNNABLE.match(info):
                raise ValueError(f"{path.name}: bad info string {info!r}; use 'python runnable [ranks=N]'")
            found = RUNNABLE.match(info)
            if found:
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((f"{path.name}:{line}", int(found["ranks"] or 1), match["code"]))
    return blocks


BLOCKS = runnable_blocks()


def _run(rank: int, world: int, name: str, code: str) -> bool:
    exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102 (the docs' own code)
    return True


def test_the_docs_have_runnable_blocks() -> None:
    names = {name.split(":")[0] for name, _, _ in BLOCKS}
    assert {"README.md", "training.md"} <= names, names


def test_every_python_block_runs_or_says_it_is_a_fragment() -> None:
    """A reader copies a bare ``python`` block as it is: each one is either run here (``python
    runnable``) or marked ``python fragment`` (it needs a launcher or inputs the page names)."""
    bare = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            info = match["info"].strip()
            if info.startswith("python") and not (RUNNABLE.match(info) or info == "python fragment"):
                bare.append(f"{path.name}:{text.count(chr(10), 0, match.start()) + 1} {info!r}")
    assert not bare, bare


@pytest.mark.parametrize("name, ranks, code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs(name: str, ranks: int, code: str) -> None:
    if "transformers" in code:  # import once here: the forked ranks inherit it (tens of seconds each)
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    assert run_ranks(_run, ranks, name, code, timeout_s=120) == [True] * ranks


def test_help_lists_the_public_api() -> None:
    import pydoc

    import hyperpar_gdn

    text = pydoc.render_doc(hyperpar_gdn, renderer=pydoc.plaintext)
    for name in hyperpar_gdn.__all__:
        assert f"``{name}``" in hyperpar_gdn.__doc__, f"{name} is not described in the module docstring"
        assert name in text and getattr(hyperpar_gdn, name) is not None
