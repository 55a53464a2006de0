"""Randomness from ``(run seed, round, node, purpose)``, never from global state or arrival order."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def derive(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (e.g. ``(seed, round, node, "batch")``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded by :func:`derive`."""
    import torch  # here, not above: robust.keys derives seeds in processes that never load torch

    return torch.Generator().manual_seed(derive(*parts))
