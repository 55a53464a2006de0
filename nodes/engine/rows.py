"""A round's rows: why one cannot be used, and their canonical stack.

The round engine (``nodes.engine.engine``) validates every row with these, whoever computed it.
"""

from __future__ import annotations

import math

import torch

from robust.source import Rows, as_rows

PIECE = 1 << 22  # values of a row checked at once (its float64 copy: 32 MB)


def rejection_reason(row: torch.Tensor, d: int, max_norm: float | None) -> str | None:
    """Why a node's row cannot be used (``None`` if it can)."""
    if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.numel() != d:
        shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
        return f"wrong shape {shape}, expected ({d},)"
    if row.dtype != torch.float32:
        return f"wrong dtype {row.dtype}, expected torch.float32 (the model's)"
    pieces = row.split(PIECE)  # a 100M-parameter row's float64 copy would be 800 MB at once
    if not all(bool(torch.isfinite(piece).all()) for piece in pieces):
        return "non-finite values"
    if max_norm is not None:
        norms = [torch.linalg.vector_norm(piece.to(torch.float64)) for piece in pieces]
        norm = float(norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms)))
        if not math.isfinite(norm) or norm > max_norm:
            return f"norm {norm:.4g} above the bound {max_norm:.4g}"
    return None


def stacked(rows: dict[str, torch.Tensor], d: int) -> tuple[list[str], torch.Tensor]:
    """Node ids sorted, and their ``(d,)`` rows stacked in that (canonical) order (``(0, d)``
    if none). ``nodes.engine.engine.canonical`` puts rows already stacked in that order."""
    ids = sorted(rows)
    return ids, torch.stack([rows[i] for i in ids]) if ids else torch.empty(0, d)


def rejected_rows(rows: torch.Tensor | Rows, max_norm: float | None) -> dict[int, str]:
    """Reasons for the rows of a stacked ``(n, d)`` matrix (or a source) that cannot be used.

    One vectorised screen (a row norm is finite and in bounds only if the row is), then
    :func:`rejection_reason` on the screened rows alone, so the reasons are the same words and
    the bound is decided in float64, as for a single reply: the screen takes rows a rounding
    error inside the bound too. A source is screened block by block (one pass), each block's
    squares summed in float64 by one fused reduction (``vector_norm``: a third of the time of
    a float64 copy squared and summed, and only a screen).
    """
    source = as_rows(rows)
    squares = torch.zeros(source.n, dtype=torch.float64, device=source.device)
    for _, block in source.blocks():
        squares += torch.linalg.vector_norm(block, dim=1, dtype=torch.float64).square()
    norms = squares.sqrt()
    flagged = ~torch.isfinite(norms)
    if max_norm is not None:
        flagged |= norms > max_norm * (1 - 1e-4)
    reasons = {i: rejection_reason(source.row(i), source.d, max_norm) for i in flagged.nonzero().flatten().tolist()}
    return {i: r for i, r in reasons.items() if r is not None}
