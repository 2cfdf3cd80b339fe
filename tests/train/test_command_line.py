"""scripts/train.py's command line is derived from TrainConfig's fields: every field is an option
with the field's type and default, and the docs' option table lists exactly these options with
these defaults (wherever under docs/ the table lives)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hyperpar_gdn.cli import UsageError
from hyperpar_gdn.train.command_line import build_parser, parse_args
from hyperpar_gdn.train.config import TrainConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _options() -> dict[str, dataclasses.Field]:
    """``--flag`` -> the TrainConfig field it sets, from the parser."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    parser = build_parser()
    return {a.option_strings[0]: fields[a.dest] for a in parser._actions if a.dest != "help"}


def test_every_field_is_an_option_with_its_default_and_type() -> None:
    options = _options()
    assert sorted(f.name for f in options.values()) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert options["--model"].name == "model_dir" and options["--no-auto-resume"].name == "auto_resume"
    assert parse_args([]) == TrainConfig()
    assert parse_args(["--no-doc-boundaries", "--fsdp"]) == TrainConfig(doc_boundaries=False, fsdp=True)
    assert parse_args(["--max-memory-gb", "1.5", "--cp-size", "2"]).max_memory_gb == 1.5
    assert parse_args(["--tp", "2", "--cp-size", "2"]) == TrainConfig(tp=2, cp_size=2)
    with pytest.raises(UsageError, match=r"argument --cp-size: invalid int value: '2.5'"):
        parse_args(["--cp-size", "2.5"])
    with pytest.raises(UsageError, match=r"argument --dtype: invalid choice: 'fp16'"):
        parse_args(["--dtype", "fp16"])


def _option_table() -> tuple[Path, list[list[str]]]:
    """The one markdown table under docs/ whose first column lists train.py's options."""
    found = []
    for path in sorted(DOCS.rglob("*.md")):
        for block in re.split(r"\n(?!\|)", path.read_text()):  # runs of consecutive table lines
            rows = [
                [cell.strip() for cell in line.strip().strip("|").split("|")]
                for line in block.splitlines()
                if line.startswith("| `--")
            ]
            if {"`--seq-len`", "`--save-every`", "`--check-parity`"} <= {row[0] for row in rows}:
                found.append((path, rows))
    assert len(found) == 1, f"train.py's option table should be in one file under docs/; found {found}"
    return found[0]


def test_docs_option_table_lists_every_option_with_its_default() -> None:
    path, rows = _option_table()
    options = _options()
    table = {row[0].strip("`"): row[1] for row in rows}
    assert sorted(table) == sorted(options), f"{path}: the table's options differ from TrainConfig's fields"
    for flag, field in options.items():
        shown = table[flag].strip("`")
        if isinstance(field.default, bool):
            assert shown == "off", f"{path}: {flag} is a switch, off unless given; the table says {shown!r}"
        elif isinstance(field.default, (int, float)):
            assert float(shown) == field.default, f"{path}: {flag} defaults to {field.default}, not {shown}"
        elif field.default is not None:
            assert shown == field.default, f"{path}: {flag} defaults to {field.default}, not {shown}"
        else:  # None: the table says in words what it means
            assert re.search(r"[a-z]", shown), f"{path}: {flag} has no default in the table"
