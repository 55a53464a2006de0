"""``int8:block=256``: per-block symmetric 8-bit quantisation, 1 byte per coordinate + 4 per block.

The row is cut into blocks of ``block`` consecutive coordinates (the last one may be shorter);
block ``b`` gets one float32 scale and every coordinate one int8:

    s_b = max_{j in b} |x_j| / 127   (float32, rounded up),   q_j = round(x_j / s_b) in [-127, 127],
    x_hat_j = q_j * s_b,             so  |x_j - x_hat_j| <= s_b / 2  (+ float32 rounding of the product)

Rounding ``s_b`` up (never down) keeps ``|x_j / s_b| <= 127``: no coordinate is clipped, and a
block of subnormal values still gets a non-zero scale; ``s_b`` is capped where ``127 s_b`` would
overflow float32 (rows near float32's maximum). A block of zeros has ``s_b = 0``. This is
the blockwise absmax quantisation of Dettmers et al., "8-bit Optimizers via Block-wise
Quantization" (ICLR 2022); per-block scaling bounds the error by each block's own magnitude, as in
QSGD's per-bucket norms (Alistarh et al., NeurIPS 2017), here deterministic (round to nearest, no
stochastic rounding) so the same row always gives the same bits.

Decoding refuses q = -128 (the symmetric code never sends it) and negative or non-finite scales.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FLOAT32, INT8, Blocked, Encoded, Layout, block_param, register

# the largest float32 scale whose 127 multiple is finite: a row near float32's maximum still decodes
SCALE_MAX = float(np.nextafter(np.float32(np.finfo(np.float32).max / 127), np.float32(0)))


@register
class Int8(Blocked):
    name = "int8"

    params = (block_param(256),)

    def layout(self, d: int) -> Layout:
        return {"q": (INT8, d), "scale": (FLOAT32, self.blocks(d))}

    def _encode(self, row: torch.Tensor, key: tuple) -> Encoded:
        d, nb = row.numel(), self.blocks(row.numel())
        width = min(self.block, d)  # a block wider than the row pads to d, not to block
        x = torch.zeros(nb * width, dtype=torch.float64)
        x[:d] = row
        x = x.view(nb, width)
        exact = x.abs().amax(dim=1) / 127  # float64: exact enough to round up from
        scale = exact.float()
        scale = torch.where(scale.double() < exact, torch.nextafter(scale, torch.tensor(torch.inf)), scale)
        scale = scale.clamp_max(SCALE_MAX)
        s = scale.double().unsqueeze(1)
        # |x / s| <= 127 as s was rounded up; only the SCALE_MAX cap may exceed it, by ~1e-7
        q = torch.where(s > 0, x / s, 0.0).round().clamp(-127, 127)
        return {
            "q": q.flatten()[:d].to(torch.int8).numpy().astype(INT8, copy=False),
            "scale": scale.numpy().astype(FLOAT32, copy=False),
        }

    def _decode(self, arrays: Encoded, d: int) -> np.ndarray:
        q, scale = arrays["q"], arrays["scale"]
        self._check_finite("scale", scale)
        if (scale < 0).any():
            raise ValueError(f"{self.name} array 'scale' holds negative values: scales are max|x| / 127 >= 0")
        if (q == -128).any():
            raise ValueError(f"{self.name} array 'q' holds -128: symmetric int8 codes lie in [-127, 127]")
        width = min(self.block, d)
        return q.astype(FLOAT32) * np.repeat(scale, width)[:d]
