"""How the bench report writes values: numbers, rounds and markdown tables.

One module so that every section of ``summary.md`` (``evaluation.reports.summary``, the time and bytes
of ``evaluation.reports.time_section``) and every plot label writes a value the same way. ``—`` stands
for a value the records do not have.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence


def show(value: object) -> str:
    """A config value as text: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def format_value(value: object) -> str:
    """A swept parameter value as the engine writes it in the attack spec."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def pct(fraction: float | None) -> str:
    """A fraction as a percentage (or percentage points) with one decimal."""
    return "—" if fraction is None else f"{100 * fraction:.1f}"


def num(value: float | None) -> str:
    """A number with two decimals; NaN (no score) is ``—``."""
    return "—" if value is None or math.isnan(value) else f"{value:.2f}"


def rounds(value: float | None) -> str:
    """A round count; ``inf`` (never) is ``never``."""
    if value is None:
        return "—"
    return "never" if math.isinf(value) else f"{value:g}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines, ending with a blank one."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]
