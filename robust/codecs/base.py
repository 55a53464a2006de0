"""What every codec shares: the wire layout, the one validating decode, the registry.

A codec turns an update row ``(d,)`` float32 into named one-dimensional numpy arrays
(:data:`Encoded`: one Flower ``ArrayRecord``'s worth) and back. :meth:`Codec.layout` states,
from ``d`` alone, the name, dtype and exact length of every array an honest node sends.
:meth:`Codec.decode` is the coordinator's gate for untrusted input: it checks an encoding
against that layout *before* it reads a value (a claimed length of 1e12 is a rejection, not an
allocation), then the codec checks the values. Anything malformed is a ``ValueError`` with a
one-line reason; anything that decodes is a finite ``(d,)`` float32 row (whether it is a
*good* row is the engine's business). Decoding is plain IEEE float32/64 arithmetic in numpy:
the same encoding gives the same bits on every run.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar

import numpy as np
import torch

from robust.constraints import Interval, Param
from robust.registry import Component, Registry
from robust.spec import Component as SpecComponent

Encoded = dict[str, np.ndarray]  # what travels: named 1-D arrays
Layout = dict[str, tuple[np.dtype, int]]  # name -> (dtype, length) of each array, from d alone

# explicit byte order: '>f4' from a node is a rejection, not a silent byte swap
FLOAT32, FLOAT16, INT8, INT32 = (np.dtype(t) for t in ("<f4", "<f2", "i1", "<i4"))

REGISTRY: Registry[Codec] = Registry("codec")
register = REGISTRY.register


def nbytes(enc: Encoded) -> int:
    """Bytes of values on the wire (the arrays' ``nbytes``; ``.npy`` headers not counted)."""
    return sum(int(a.nbytes) for a in enc.values())


class Codec(Component):
    """Base of every codec. ``biased``: ``E[decode(encode(x))] != x``, so a node should encode
    with :func:`robust.codecs.error_feedback`; ``keyed``: ``encode`` needs a non-empty ``key``."""

    biased: ClassVar[bool] = False
    keyed: ClassVar[bool] = False

    def __init__(self, f: int = 0, **params: object) -> None:
        super().__init__(f, **params)  # the registry's constructor signature; a codec does not use f

    @property
    def spec(self) -> str:
        """The canonical spec text that builds this codec (e.g. ``"topk:k=0.01"``)."""
        return str(SpecComponent(self.name, {k: getattr(self, k) for k in self.declared()}))

    def __repr__(self) -> str:
        return f"codec {self.spec!r}"

    def layout(self, d: int) -> Layout:
        """Name, dtype and length of every array an encoded ``(d,)`` row holds."""
        raise NotImplementedError

    def nbytes(self, d: int) -> int:
        """Bytes of values an encoded ``(d,)`` row takes on the wire."""
        return sum(dtype.itemsize * length for dtype, length in self.layout(d).values())

    def ratio(self, d: int) -> float:
        """How many times fewer bytes than float32 a ``(d,)`` row takes (for reports)."""
        return 4 * d / self.nbytes(d)

    def encode(self, row: torch.Tensor, key: tuple = ()) -> Encoded:
        """The arrays that carry ``row``, a finite ``(d,)`` float32 tensor. ``key`` seeds the
        codecs that draw at random (``keyed``), e.g. ``(run seed, round, node id)``."""
        if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.numel() < 1:
            shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
            raise ValueError(f"{self.name} encodes one row of shape (d,) with d >= 1 (got {shape})")
        if row.dtype != torch.float32:
            raise ValueError(f"{self.name} encodes float32 rows (got {row.dtype}): convert with row.float()")
        if not bool(torch.isfinite(row).all()):
            raise ValueError(f"{self.name} cannot encode a row with NaN or Inf: the update is unusable, send none")
        if not isinstance(key, tuple):
            raise ValueError(f"{self.name} key must be a tuple such as (seed, round, node) (got {type(key).__name__})")
        self.layout(row.numel())  # refuses a d the codec cannot carry
        return self._encode(row.detach().cpu(), key)

    def decode(self, enc: Encoded, d: int) -> torch.Tensor:
        """The ``(d,)`` float32 row ``enc`` carries; ``ValueError`` with the reason if ``enc``
        is not exactly what this codec sends for ``d`` coordinates. Never aliases ``enc``."""
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"{self.name} decodes rows of d >= 1 coordinates (got d={d!r})")
        arrays = self._check_layout(enc, d)
        with np.errstate(all="ignore"):  # overflow is caught below, as a reason, not a warning
            out = self._decode(arrays, d)
        if not np.isfinite(out).all():
            raise ValueError(f"{self.name} update decodes to non-finite values (its values overflow float32)")
        return torch.from_numpy(out)

    def refusal(self, enc: Encoded, key: tuple) -> str | None:
        """Why an encoding that decodes does not answer the task of ``key`` = ``(run seed, task
        number, node id)``: what it claims on the wire breaks the task (``shared-sign``'s
        support); ``None`` if it answers it, as for every codec that claims nothing."""
        return None

    def _encode(self, row: torch.Tensor, key: tuple) -> Encoded:
        raise NotImplementedError

    def _decode(self, arrays: Encoded, d: int) -> np.ndarray:
        """A fresh ``(d,)`` float32 array from arrays that match :meth:`layout`."""
        raise NotImplementedError

    def _check_layout(self, enc: object, d: int) -> Encoded:
        """``enc`` if its names, types, dtypes and shapes are the layout's; reads no value."""
        if not isinstance(enc, dict):
            raise ValueError(f"{self.name} update is a {type(enc).__name__}, expected a dict of arrays")
        want = self.layout(d)
        if set(enc) != set(want):
            missing, extra = [k for k in want if k not in enc], [k for k in enc if k not in want]
            raise ValueError(f"{self.name} update has arrays {_listed(list(enc))}, expected {_listed(list(want))}"
                             f" (missing {_listed(missing)}, extra {_listed(extra)})")
        for name, (dtype, length) in want.items():
            a = enc[name]
            if type(a) is not np.ndarray:
                raise ValueError(f"{self.name} array {name!r} is a {type(a).__name__:.40}, expected numpy.ndarray")
            if a.dtype != dtype:
                raise ValueError(f"{self.name} array {name!r} holds {str(a.dtype):.40}, expected {dtype} ({dtype.str})")
            if a.shape != (length,):
                raise ValueError(f"{self.name} array {name!r} has shape {a.shape}, expected ({length},) for d={d}")
        return enc

    def _check_finite(self, name: str, a: np.ndarray) -> None:
        if not np.isfinite(a).all():
            raise ValueError(f"{self.name} array {name!r} holds NaN or Inf")


def share_of(d: int, k: float) -> int:
    """How many of ``d`` coordinates a fraction ``k`` keeps: ``max(1, ceil(k d))`` for the
    decimal ``k`` of the spec (``0.07 * 100`` keeps 7, not 8), as ``topk``, ``randk`` and
    ``shared-sign`` count them."""
    return max(1, math.ceil(Fraction(repr(k)) * d))


def _listed(keys: list, limit: int = 4) -> str:
    """A short, safe rendering of (untrusted) array names."""
    shown = ", ".join(f"{k!r:.40}" for k in keys[:limit])
    return "[" + shown + (f", ... {len(keys) - limit} more" if len(keys) > limit else "") + "]"


def block_param(default: int) -> Param:
    """``block``, the coordinates that share one float32 scale, with a codec's own default."""
    return Param("block", Interval(int, 1, None), default, "coordinates per float32 scale")


class Blocked(Codec):
    """A codec with one float32 scale per block of ``block`` consecutive coordinates (the last
    block may be shorter); a subclass declares ``block`` with its default (:func:`block_param`)."""

    block: int

    def blocks(self, d: int) -> int:
        """How many scales a ``(d,)`` row takes: ``ceil(d / block)``."""
        return -(-d // self.block)
