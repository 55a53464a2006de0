"""One timed method of ``robust agg-bench``: ours, Flower's or ByzFL's, in the same shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Baseline:
    """``prepare()`` (untimed) builds what one call needs, afresh for every call; ``run(state)``
    is the call timed."""

    name: str
    prepare: Callable[[], object]
    run: Callable[[object], object]
