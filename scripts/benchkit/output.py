"""A benchmark's output: the JSON (rewritten as parts finish) and a PNG of panels."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Panel", "save_png", "write_json"]


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON, creating the folder (call after every finished part:
    a long run cut short keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


@dataclass
class Panel:
    """One plot: ``lines`` label -> [(x, y), ...]; ``points`` label -> [(x, y), ...] drawn as
    unconnected square markers (a map of where something holds; a label's colour follows its
    place in the dict, so give every panel the same labels, empty ones too); ``bars`` label -> (height,
    colour) in order; ``hlines`` label -> (y, style) reference lines (targets, bounds)."""

    title: str
    xlabel: str
    ylabel: str
    lines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    bars: dict[str, tuple[float, str]] = field(default_factory=dict)
    hlines: dict[str, tuple[float, str]] = field(default_factory=dict)
    points: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    log2_x: bool = False
    log2_y: bool = False
    ylim: tuple[float, float] | None = None


def save_png(path: Path, panels: Sequence[Panel], *, width: float = 5.0, dpi: int = 100) -> None:
    """Draw ``panels`` side by side into ``path`` (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, points in panel.lines.items():
            if points:
                ax.plot(*zip(*sorted(points), strict=True), "o-", label=label)
        for i, (label, points) in enumerate(panel.points.items()):  # colour by place: stable across panels
            if points:
                ax.scatter(*zip(*points, strict=True), marker="s", s=80, color=f"C{i}", label=label)
        if panel.bars:
            names = list(panel.bars)
            ax.bar(
                range(len(names)),
                [h for h, _ in panel.bars.values()],
                color=[c for _, c in panel.bars.values()],
            )
            ax.set_xticks(range(len(names)), names, fontsize=7)
        for label, (y, style) in panel.hlines.items():
            ax.axhline(y, color="k" if style == "--" else "C2", ls=style, lw=1, label=label)
        if panel.log2_x:
            ax.set_xscale("log", base=2)
        if panel.log2_y:
            ax.set_yscale("log", base=2)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel, title=panel.title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
