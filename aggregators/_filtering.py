"""What the rules that detect and drop rows (DnC, SignGuard, FLAME) share.

**Seeding.** A rule is called as ``rule(X)``, with no round number, and must give the same
bits for the same rows whatever their order. Its randomness is therefore a function of the
call's input: every row is hashed (SHA-256 of its bytes), the digests are sorted, and a
generator is seeded (``robust.seeds.derive``) with the rule's name, its ``seed`` parameter and
the sorted digests. A new round brings new rows and so fresh draws; the same rows in any order
give the same draws; the rule keeps no state, so an object called twice on the same rows
answers the same and a resumed run replays the same bits. Whoever knows ``seed`` can predict
the draw of a given ``X`` (and a Byzantine node can try variants of its row): keep ``seed`` out
of public configs where that matters.

**Order.** Every discrete choice (the rows scored highest, the largest cluster, ties) is made
on the rows sorted by digest (:func:`content_order`), with the statistics it reads computed on
that order too, so the choice is exactly order-invariant. Only the final weighted mean runs
over ``X`` in its own order: the aggregate is order-invariant up to rounding.
"""

from __future__ import annotations

import hashlib

import torch

from robust.geometry import weighted_sum
from robust.seeds import generator
from robust.source import Rows, row_hashes

F64 = torch.float64


def content_order(X: Rows) -> tuple[torch.Tensor, str]:
    """``(order, digest)``: the row indices sorted by the SHA-256 of each row's bytes (equal
    rows keep their relative order), and the hex SHA-256 of the sorted row digests; one
    pass over the blocks (a hash is fed a row's bytes block by block)."""
    digests = [h.digest() for h in row_hashes(X)]
    order = sorted(range(len(digests)), key=digests.__getitem__)
    combined = hashlib.sha256(b"".join(digests[i] for i in order)).hexdigest()
    return torch.tensor(order, dtype=torch.long, device=X.device), combined


def draws(X: Rows, name: str, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    """The content order of ``X``'s rows and the generator of this call (see the module docstring)."""
    order, digest = content_order(X)
    return order, generator("aggregator", name, seed, digest)


def gram(X: Rows, order: torch.Tensor, pairs: bool) -> torch.Tensor:
    """Float64 Gram matrix ``(n, n)`` of the rows ``X[order]`` (only its diagonal, the squared
    norms ``(n,)``, when not ``pairs``), accumulated over column blocks in one pass.
    A row's entries are computed from the rows in content order, so they are the same bits for
    the same rows in any order."""
    n = X.n
    out = torch.zeros((n, n) if pairs else (n,), dtype=F64, device=X.device)
    for _, block in X.blocks():
        block = block[order].to(F64)
        out += block @ block.T if pairs else block.square().sum(dim=1)
    return out


def clipped_mean(X: Rows, order: torch.Tensor, kept: torch.Tensor, norms: torch.Tensor,
                 bound: torch.Tensor) -> torch.Tensor:
    """``(1/|K|) sum_{i in K} x_i min(1, bound / ||x_i||)``, with ``kept`` (bool) and ``norms``
    given for the rows in content ``order``; one pass over ``X``."""
    scale = torch.where(norms > bound, bound / norms, 1.0) * kept
    weights = torch.empty_like(scale)
    weights[order] = scale / kept.sum()
    return weighted_sum(X, weights)


def in_input_order(kept: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``kept`` given for the rows in content ``order``, as a bool mask over ``X``'s rows."""
    mask = torch.empty_like(kept)
    mask[order] = kept
    return mask
