"""The floor under a distance-based rule: one float64 Gram pass over the rows, nothing else.

A rule that picks rows by their exact distances (Krum, Multi-Krum, Bulyan, MDA, NNM) reads
every block of the rows, converts it to float64, centres it and adds its Gram matrix
(``robust.geometry.sq_distances``). The floor is the products alone: ``sum_blocks B B^T`` over
the same ``robust.source.BLOCK``-column blocks, already float64 and contiguous (converted
untimed, afresh for each call), which no implementation of exact float64 distances can skip.
``robust agg-bench --peers`` times it in turns with the rule and prints the rule's time as a
multiple of it.
"""

from __future__ import annotations

import torch

from robust.source import BLOCK
from robust.spec import parse

from .baseline import Baseline

DISTANCE_RULES = {"krum", "multi-krum", "bulyan", "mda", "nnm"}  # stages that read the exact distances
NAME = "one float64 Gram pass"


def baselines(spec: str, X: torch.Tensor) -> list[Baseline]:
    """The Gram pass for ``spec`` when one of its stages reads exact distances (else none)."""
    if not DISTANCE_RULES & {c.name for c in parse(spec)}:
        return []

    def prepare() -> list[torch.Tensor]:
        return [X[:, s : s + BLOCK].to(torch.float64, memory_format=torch.contiguous_format)
                for s in range(0, X.shape[1], BLOCK)]

    def run(blocks: list[torch.Tensor]) -> torch.Tensor:
        gram = torch.zeros(X.shape[0], X.shape[0], dtype=torch.float64)
        for block in blocks:
            gram += block @ block.T
        return gram

    return [Baseline(NAME, prepare, run)]
