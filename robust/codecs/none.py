"""``none``: the row's float32 values as they are (lossless; the reference for byte ratios)."""

from __future__ import annotations

import numpy as np
import torch

from .base import FLOAT32, Codec, Encoded, Layout, register


@register
class NoCodec(Codec):
    name = "none"

    def layout(self, d: int) -> Layout:
        return {"x": (FLOAT32, d)}

    def _encode(self, row: torch.Tensor, key: tuple) -> Encoded:
        return {"x": row.numpy().astype(FLOAT32, copy=True)}  # a copy: the caller may change row

    def _decode(self, arrays: Encoded, d: int) -> np.ndarray:
        self._check_finite("x", arrays["x"])
        return arrays["x"].copy()
