"""``fp16``: half precision, 2 bytes per coordinate.

``x_hat = float32(fp16(clamp(x, -65504, 65504)))``: round to nearest even, so the relative
error is at most 2^-11 for |x| >= 2^-14 (fp16's normal range) and the absolute error at most
2^-25 below it. Values beyond fp16's range **saturate** at +-65504 (the largest finite half)
instead of becoming infinities the coordinator would reject: an honest node's oversized
coordinate is clipped, never lost. A decoded NaN or Inf can thus only come from a node that did
not use this encoder, and is a rejection.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FLOAT16, FLOAT32, Codec, Encoded, Layout, register

FP16_MAX = 65504.0


@register
class Fp16(Codec):
    name = "fp16"

    def layout(self, d: int) -> Layout:
        return {"x": (FLOAT16, d)}

    def _encode(self, row: torch.Tensor, key: tuple) -> Encoded:
        return {"x": row.clamp(-FP16_MAX, FP16_MAX).half().numpy().astype(FLOAT16, copy=False)}

    def _decode(self, arrays: Encoded, d: int) -> np.ndarray:
        self._check_finite("x", arrays["x"])
        return arrays["x"].astype(FLOAT32)
