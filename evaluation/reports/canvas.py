"""What every plot of the bench report draws with: a figure on matplotlib's Agg canvas, its
PNG, and one colour per attack.

Figures are built without pyplot, so no backend or global figure list is touched and nothing
stays open once a figure is saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .results import CLEAN


def new_figure(width: float, height: float) -> Figure:
    """An empty figure of ``width`` x ``height`` inches, laid out by matplotlib."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Figure, path: str | Path) -> Path:
    """Write ``figure`` to ``path`` as a PNG; return the path."""
    figure.savefig(path, dpi=120)
    return Path(path)


def palette(attacks: Sequence[str]) -> dict[str, str]:
    """A fixed colour per attack (the clean run in black), the same in every panel."""
    others = [a for a in attacks if a != CLEAN]
    return {CLEAN: "black", **{a: f"C{i}" for i, a in enumerate(others)}}
