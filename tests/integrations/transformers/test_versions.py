"""The tested transformers range: inside it no line, outside it one warning line naming the range,
on rank 0 only and once per process; pyproject.toml's extras declare the same range."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from hyperpar_gdn.integrations.transformers import versions
from hyperpar_gdn.integrations.transformers.versions import TESTED_TRANSFORMERS, untested_transformers

ROOT = Path(__file__).resolve().parents[3]
tomllib = pytest.importorskip("tomllib")


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0", "5.25.1"])
def test_inside_the_range_no_line(version: str) -> None:
    assert untested_transformers(version) is None
    assert untested_transformers(None) is None  # not installed


@pytest.mark.parametrize("version", ["5.23.0", "5.26.0", "6.0.0", "4.57.6"])
def test_outside_the_range_one_line_naming_it(version: str) -> None:
    line = untested_transformers(version)
    assert line is not None and "\n" not in line
    assert f"transformers {version} is outside the tested range transformers>=5.24.0,<5.26" in line


def test_the_warning_is_one_line_on_rank_0_once(monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setattr(metadata, "version", lambda name: "5.26.0" if name == "transformers" else "0")
    for rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        versions.warn_if_untested.cache_clear()
        versions.warn_if_untested()
        versions.warn_if_untested()  # once per process
        lines = capfd.readouterr().err.splitlines()
        assert len(lines) == expected, lines
    assert "outside the tested range" in lines[0]
    versions.warn_if_untested.cache_clear()


def test_the_installed_release_imports_without_a_line() -> None:
    """The environment the tests run in holds a tested release: importing the integration is silent."""
    pytest.importorskip("transformers")
    assert untested_transformers(metadata.version("transformers")) is None
    result = subprocess.run(
        [sys.executable, "-c", "import hyperpar_gdn.integrations.transformers"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_pyproject_declares_the_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("transformers", "trainer"):
        assert f"transformers{TESTED_TRANSFORMERS}" in extras[extra], extras[extra]
