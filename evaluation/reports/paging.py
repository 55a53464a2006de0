"""Big grids in readable pieces: the report's wide tables and many-panel plots split into
pages by family, whole families on a page as far as they fit.

An attack's family is its name without parameters (``drift:eps=0.1`` is ``drift``); a
defence's is its last rule, the one that aggregates (``nnm+trimmed-mean`` is
``trimmed-mean``). A grid of at most ``PAGE`` attacks and ``PAGE`` defences is one page, as
before; the quick grid (5 x 7) is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from .results import CLEAN

T = TypeVar("T")
PAGE = 12  # the rows, columns or panels one table or plot holds before it is split


def attack_family(spec: str) -> str:
    """``drift:eps=0.1`` -> ``drift``."""
    return spec.split(":", 1)[0]


def defence_family(spec: str) -> str:
    """``bucketing:s=2+centered-clipping:tau=10`` -> ``centered-clipping``."""
    return attack_family(spec.rsplit("+", 1)[-1])


def pages(items: Sequence[T], family: Callable[[T], str], limit: int = PAGE) -> list[list[T]]:
    """``items`` on pages of at most ``limit``, in their order within a family: families in
    first-seen order, each whole on the current page if it fits there, else on a new one; a
    family longer than a page fills pages of its own."""
    families: dict[str, list[T]] = {}
    for item in items:
        families.setdefault(family(item), []).append(item)
    out: list[list[T]] = []
    for members in families.values():
        if out and len(out[-1]) + len(members) <= limit:
            out[-1].extend(members)
            continue
        out += [members[i:i + limit] for i in range(0, len(members), limit)]
    return out


def page_paths(path: str | Path, count: int) -> list[Path]:
    """``path`` for one page; ``stem-1.png``, ``stem-2.png``, ... for several."""
    path = Path(path)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(1, count + 1)]


def sheets(aggregators: Sequence[str], attacks: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """The pages of a defence x attack grid, as (defences, attacks): defences by family,
    attacks by family with ``none`` (the reference) on every page."""
    clean = [a for a in attacks if a == CLEAN]
    others = [a for a in attacks if a != CLEAN]
    columns = [clean + page for page in pages(others, attack_family, PAGE - len(clean))] or [clean]
    return [(rows, page) for rows in pages(aggregators, defence_family) for page in columns]


def sheet_name(number: int, count: int, defences: Sequence[str], attacks: Sequence[str]) -> str:
    """Which page of how many, and the families it holds."""
    shown = [a for a in attacks if a != CLEAN]
    return (f"page {number} of {count}: attacks {_families(shown, attack_family)}; "
            f"defences {_families(defences, defence_family)}")


def sheet_title(title: str, number: int, count: int, defences: Sequence[str], attacks: Sequence[str]) -> str:
    """``title``, and on a page of several which it is."""
    return title if count == 1 else f"{title}\n{sheet_name(number, count, defences, attacks)}"


def _families(items: Sequence[str], family: Callable[[str], str]) -> str:
    return ", ".join(dict.fromkeys(family(item) for item in items))
