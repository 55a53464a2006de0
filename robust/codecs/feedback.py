"""Error feedback: the node-side memory that makes a biased codec (``topk``) converge.

The node keeps a residual ``e`` (a float32 ``(d,)`` row, zero at first) and each round sends

    p_t = x_t + e_{t-1},   send C(p_t),   e_t = p_t - C(p_t)

so nothing is lost, only delayed: ``sum_t C(p_t) + e_T = sum_t x_t``. Stich, Cordonnier &
Jaggi, "Sparsified SGD with Memory" (NeurIPS 2018); Karimireddy et al., "Error Feedback Fixes
SignSGD and other Gradient Compression Schemes" (ICML 2019).
"""

from __future__ import annotations

import torch

from .base import Codec, Encoded


def error_feedback(
    codec: Codec, row: torch.Tensor, residual: torch.Tensor | None, key: tuple = ()
) -> tuple[Encoded, torch.Tensor]:
    """Encode ``row + residual`` (``None``: no residual yet); return the encoding and the new
    residual, what the encoding left out (computed from the decoded row, as the coordinator
    sees it)."""
    target = row
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != row.shape or residual.dtype != row.dtype:
            got = (tuple(residual.shape), residual.dtype) if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise ValueError(f"the residual must match the row, {tuple(row.shape)} {row.dtype} (got {got}): "
                             "reset it (None) when the model or the codec changes")
        target = row + residual.to(row.device)
    enc = codec.encode(target, key)
    return enc, target.detach().cpu() - codec.decode(enc, target.numel())
