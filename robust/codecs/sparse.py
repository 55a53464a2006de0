"""What top-k and rand-k share: ``m`` kept coordinates sent as ``(idx, val)``.

``m = max(1, ceil(k d))`` for the decimal ``k`` of the spec (``0.07 * 100`` keeps 7, not 8);
``idx`` are int32 in ``[0, d)``, strictly ascending; ``val`` float32, the row's values there.
The decoded row is ``gain * val`` at ``idx`` and zero elsewhere. An honest node sends exactly
``m`` entries, so a count other than ``m`` is a rejection: a node cannot send more coordinates
than the codec allows. 8 bytes per kept coordinate: ``ratio = 4d / 8m`` (50x at ``k = 0.01``).
"""

from __future__ import annotations

import numpy as np
import torch

from robust.constraints import Interval, Param

from .base import FLOAT32, INT32, Codec, Encoded, Layout, share_of

MAX_D = 2**31 - 1  # int32 indices


class SparseCodec(Codec):
    params = (Param("k", Interval(float, 0, 1, "right"), 0.01, "the fraction of coordinates sent"),)

    def count(self, d: int) -> int:
        """``m``: how many coordinates of a ``(d,)`` row are sent."""
        return share_of(d, self.k)

    def gain(self, d: int) -> float:
        """The factor decoding applies to the sent values."""
        return 1.0

    def layout(self, d: int) -> Layout:
        if d > MAX_D:
            raise ValueError(f"{self.name} sends int32 indices: d={d} exceeds {MAX_D}, use int8 or fp16")
        m = self.count(d)
        return {"idx": (INT32, m), "val": (FLOAT32, m)}

    def _pack(self, row: torch.Tensor, idx: torch.Tensor) -> Encoded:
        """The encoding of ``row``'s values at ascending indices ``idx``."""
        return {
            "idx": idx.to(torch.int32).numpy().astype(INT32, copy=False),
            "val": row[idx].numpy().astype(FLOAT32, copy=False),
        }

    def _decode(self, arrays: Encoded, d: int) -> np.ndarray:
        idx, val = arrays["idx"], arrays["val"]
        self._check_finite("val", val)
        if (idx < 0).any() or (idx >= d).any():
            raise ValueError(f"{self.name} array 'idx' holds indices outside [0, {d})")
        steps = np.diff(idx)
        if (steps == 0).any():
            raise ValueError(f"{self.name} array 'idx' repeats an index")
        if (steps < 0).any():
            raise ValueError(f"{self.name} array 'idx' is not sorted ascending")
        out = np.zeros(d, dtype=FLOAT32)
        gain = self.gain(d)
        # float64 product, one rounding to float32: the same bits on every run
        out[idx] = val if gain == 1.0 else (val.astype(np.float64) * gain).astype(FLOAT32)
        return out
