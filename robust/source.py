"""A round's rows as an ``(n, d)`` source read in column blocks: in memory, or spooled on disk.

Every rule, pre-aggregator and detector reads the rows through :meth:`Rows.blocks`: the
columns ``[s, s + BLOCK)`` of every row as a fresh contiguous ``(n, b)`` tensor, block after
block. A tensor in memory (:class:`Memory`) and rows stored one file per row
(:class:`Spooled`, the audit's ``updates/<sha256>.npy``) hand out the same blocks, value for
value and in the same layout, so a computation written on blocks gives the same bits from
either source. Memory stays ``n x BLOCK`` per block in flight plus the spool's read-ahead:
a round no longer needs its ``(n, d)`` matrix in memory.

A pass that uses each block once, converted (a Gram matrix, norms, a weighted sum), reads
:meth:`Rows.read` instead: the same values, each of the source's :meth:`Rows.views`
(read-only blocks valid until the next: in memory, strided views of the tensor; on disk, the
spool's read buffer) converted into one reused scratch buffer while it is copied, so a
float64 pass over 400 MB of float32 rows writes 6.5 MB once rather than 1.2 GB anew.

A pre-aggregator returns a lazy source (:class:`Transformed`): each of its blocks is computed
from the input's block when read, so a chain holds no intermediate ``(n, d)`` matrix either.

A source is read on another device (a GPU) through :func:`on_device`: each block is moved
there as it is read, so the device holds blocks, never the ``(n, d)`` matrix, and what is
computed on the blocks runs there.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from .params import hash_prefix, sha256

BLOCK = 8192  # columns per block: 64 rows * 8192 * 8 B = 4 MB in float64, cache-friendly
CHUNK_BYTES = 128 * 2**20  # what one read of a spool brings in (two are held: read-ahead)


class Rows:
    """An ``(n, d)`` matrix read in column blocks. ``validated``: every row is known finite."""

    n: int
    d: int
    dtype: torch.dtype
    device: torch.device
    validated: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.d)

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, block)`` for ``start = 0, BLOCK, 2*BLOCK, ...``: ``block`` is a new
        contiguous ``(n, b)`` tensor of the columns ``[start, start + b)``."""
        raise NotImplementedError

    def views(self) -> Iterator[tuple[int, torch.Tensor]]:
        """The blocks of :meth:`blocks`, each *read-only* and valid only until the next is
        asked for (it may be a strided view of memory the source reuses): the cheapest way
        to read a block once. A source that computes its blocks hands out :meth:`blocks`."""
        return self.blocks()

    def read(self, dtype: torch.dtype | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """The blocks of :meth:`blocks` converted to ``dtype`` (default the rows'), each a
        contiguous ``(n, b)`` *scratch* tensor: the caller may change it, but not keep it past
        the next block, whose values a source may write into the same memory (copy what you
        keep). The values are those of ``blocks()``, converted exactly: each of
        :meth:`views` is converted while it is copied into one buffer, where ``blocks()`` then
        ``.to()`` would write every value twice into fresh memory."""
        scratch = Scratch(self.dtype if dtype is None else dtype, self.device)
        for s, view in self.views():
            yield s, scratch.copy(view)

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` as a new ``(d,)`` tensor."""
        out = torch.empty(self.d, dtype=self.dtype, device=self.device)
        for s, block in self.blocks():
            out[s : s + block.shape[1]] = block[i]
        return out

    def tensor(self) -> torch.Tensor:
        """The whole ``(n, d)`` matrix in memory (for small rounds and tests)."""
        out = torch.empty(self.n, self.d, dtype=self.dtype, device=self.device)
        for s, block in self.blocks():
            out[:, s : s + block.shape[1]] = block
        return out

    def take(self, index: list[int]) -> Rows:
        """The rows ``index`` (in that order), as a source."""
        return Transformed(self, lambda _, block: block[index], n=len(index))

    def sha256s(self) -> list[str]:
        """Each row's ``robust.params.sha256`` (its identity in the audit store), one pass."""
        return [h.hexdigest() for h in row_hashes(self, hash_prefix(self.dtype, (self.d,)))]

    @property
    def memo(self) -> dict[str, torch.Tensor]:
        """Statistics of these rows already computed (``key`` -> value), kept with the source
        so that a round's rule and its detectors compute each once: a source's content never
        changes. A marked copy (:func:`validated`) keeps those computed before it was made;
        any other new source starts with none."""
        return self.__dict__.setdefault("_memo", {})


class Memory(Rows):
    """A tensor ``X`` of shape ``(n, d)``, read block by block (``X`` is never modified)."""

    def __init__(self, X: torch.Tensor, validated: bool = False) -> None:
        self.X = X.detach()
        self.n, self.d = X.shape
        self.dtype, self.device, self.validated = X.dtype, X.device, validated

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s in range(0, self.d, BLOCK):
            yield s, _packed(self.X[:, s : s + BLOCK])

    def views(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s in range(0, self.d, BLOCK):
            yield s, self.X[:, s : s + BLOCK]

    def row(self, i: int) -> torch.Tensor:
        return self.X[i].clone()

    def tensor(self) -> torch.Tensor:
        return self.X

    def take(self, index: list[int]) -> Rows:
        return Memory(self.X[index], self.validated)

    def sha256s(self) -> list[str]:
        return [sha256(row) for row in self.X]


class Spooled(Rows):
    """Rows stored one ``.npy`` file per row (each of shape ``(d,)``, one dtype for all), read
    in chunks of whole blocks with the next chunk read ahead while this one is used.
    ``bytes_read`` counts what the reads brought in. ``shas``: each row's SHA-256, where the
    files are a content-addressed store that the caller wrote (``None``: computed when asked)."""

    def __init__(self, paths: Sequence[str | Path], validated: bool = False,
                 device: torch.device | str = "cpu", chunk_bytes: int = CHUNK_BYTES,
                 shas: Sequence[str] | None = None) -> None:
        if not paths:
            raise ValueError("a spool needs at least one row file")
        self.paths = [Path(p) for p in paths]
        headers = [npy_header(p) for p in self.paths]
        shapes = {h[1] for h in headers}
        dtypes = {h[2] for h in headers}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"spooled rows must share one shape and dtype (got {sorted(map(str, shapes | dtypes))})")
        self.offsets = [h[0] for h in headers]
        self.np_dtype = dtypes.pop()
        self.n, self.d = len(paths), shapes.pop()[0]
        self.dtype = torch.from_numpy(np.empty(0, dtype=self.np_dtype)).dtype
        self.device, self.validated = torch.device(device), validated
        per_block = self.n * BLOCK * self.np_dtype.itemsize
        self.width = BLOCK * max(1, chunk_bytes // per_block)  # columns per read
        self.bytes_read = 0
        self.shas = None if shas is None else list(shas)
        self.chunk_bytes = chunk_bytes

    def take(self, index: list[int]) -> Rows:
        return Spooled([self.paths[i] for i in index], self.validated, self.device, self.chunk_bytes,
                       None if self.shas is None else [self.shas[i] for i in index])

    def sha256s(self) -> list[str]:
        return super().sha256s() if self.shas is None else list(self.shas)

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s, view in self._chunk_views():
            yield s, _packed(view).to(self.device)

    def views(self) -> Iterator[tuple[int, torch.Tensor]]:
        return self._chunk_views() if self.device.type == "cpu" else self.blocks()

    def _chunk_views(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, view)``: each block as a strided CPU view of the chunk read ahead, valid
        until the next block is asked for."""
        fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        buffers = [np.empty((self.n, min(self.width, self.d)), dtype=self.np_dtype) for _ in range(2)]
        try:
            with ThreadPoolExecutor(1) as reader:
                starts = range(0, self.d, self.width)
                ahead = reader.submit(self._read, fds, buffers[0], 0)
                for k, start in enumerate(starts):
                    chunk = ahead.result()
                    if k + 1 < len(starts):
                        ahead = reader.submit(self._read, fds, buffers[(k + 1) % 2], starts[k + 1])
                    for s in range(0, chunk.shape[1], BLOCK):
                        yield start + s, torch.from_numpy(chunk[:, s : s + BLOCK])
                ahead.result()  # never leave a read writing into a buffer we let go
        finally:
            for fd in fds:
                os.close(fd)

    def _read(self, fds: list[int], buffer: np.ndarray, start: int) -> np.ndarray:
        width = min(self.width, self.d - start)
        chunk = buffer[:, :width]
        size = self.np_dtype.itemsize
        for i, fd in enumerate(fds):
            view = memoryview(buffer[i, :width]).cast("B")
            done = 0
            while done < len(view):  # a read may return fewer bytes than asked
                got = os.preadv(fd, [view[done:]], self.offsets[i] + start * size + done)
                if got == 0:
                    raise OSError(f"spooled row {self.paths[i]} ends before its {self.d} values")
                done += got
            self.bytes_read += done
        return chunk

    def row(self, i: int) -> torch.Tensor:
        data = np.fromfile(self.paths[i], dtype=self.np_dtype, count=self.d, offset=self.offsets[i])
        self.bytes_read += data.nbytes
        return torch.from_numpy(data).to(self.device)


class Transformed(Rows):
    """Rows computed block by block from another source: ``fn(start, block)`` is the
    ``(n_out, b)`` block of the new rows (of ``dtype``, default the source's)."""

    def __init__(self, source: Rows, fn: Callable[[int, torch.Tensor], torch.Tensor],
                 n: int | None = None, dtype: torch.dtype | None = None) -> None:
        self.source, self.fn = source, fn
        self.n, self.d = (source.n if n is None else n), source.d
        self.dtype = source.dtype if dtype is None else dtype
        self.device, self.validated = source.device, source.validated

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s, block in self.source.blocks():
            out = self.fn(s, block)
            yield s, out if out.is_contiguous() else _packed(out)


class OnDevice(Rows):
    """The rows of ``source`` read on ``device``: each block (and a row asked for) is moved
    there as it is read; the values, and so a rule's input, are the source's."""

    def __init__(self, source: Rows, device: torch.device | str) -> None:
        self.source, self.device = source, torch.device(device)
        self.n, self.d, self.dtype, self.validated = source.n, source.d, source.dtype, source.validated

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s, block in self.source.blocks():
            yield s, block.to(self.device)

    def views(self) -> Iterator[tuple[int, torch.Tensor]]:
        return self.source.views() if self.device == self.source.device else self.blocks()

    def row(self, i: int) -> torch.Tensor:
        return self.source.row(i).to(self.device)

    def take(self, index: list[int]) -> Rows:
        return OnDevice(self.source.take(index), self.device)

    def sha256s(self) -> list[str]:
        return self.source.sha256s()  # the same bytes wherever they are read


def on_device(source: Rows, device: torch.device | str) -> OnDevice:
    """``source`` read on ``device`` block by block (see :class:`OnDevice`); the one way a round's
    rows reach the device its rule runs on, the CPU included."""
    return OnDevice(source, device)


def mixed(source: Rows, M: torch.Tensor) -> Transformed:
    """The rows ``M @ X`` (``M`` of shape ``(n_out, n)``), computed block by block."""
    M = M.to(device=source.device, dtype=source.dtype)
    return Transformed(source, lambda _, block: M @ block, n=M.shape[0])


def scaled(source: Rows, scale: torch.Tensor) -> Transformed:
    """Each row ``x_i`` times ``scale_i``, computed block by block."""
    column = scale.to(device=source.device, dtype=source.dtype)[:, None]
    return Transformed(source, lambda _, block: block * column)


def stacked(source: Rows, extra: torch.Tensor) -> Transformed:
    """The rows of ``source`` followed by the rows of ``extra`` ``(k, d)``, in float64."""
    extra = extra.to(device=source.device, dtype=torch.float64)
    return Transformed(source, lambda s, block: torch.cat([block.to(torch.float64), extra[:, s : s + block.shape[1]]]),
                       n=source.n + extra.shape[0], dtype=torch.float64)


def column_blocks(source: Rows, columns: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(positions, values)`` for the sorted ``columns`` (1-D, no repeats) block by block:
    ``values`` ``(n, k)`` holds the columns ``columns[positions]`` of every row."""
    columns = columns.to(source.device)
    for s, block in source.blocks():
        lo, hi = torch.searchsorted(columns, torch.tensor([s, s + block.shape[1]], device=columns.device)).tolist()
        if hi > lo:
            yield torch.arange(lo, hi, device=columns.device), block[:, columns[lo:hi] - s]


def take_columns(source: Rows, columns: torch.Tensor) -> torch.Tensor:
    """The ``(n, k)`` values of the given ``columns`` (1-D, any order, no repeats), one pass."""
    order = torch.sort(columns).indices
    out = torch.empty(source.n, columns.numel(), dtype=source.dtype, device=source.device)
    for positions, values in column_blocks(source, columns[order]):
        out[:, order.to(out.device)[positions]] = values
    return out


def take(X: torch.Tensor | Rows, index: list[int]) -> torch.Tensor | Rows:
    """The rows ``index`` of ``X``, of ``X``'s kind (a tensor or a source)."""
    return X[index] if isinstance(X, torch.Tensor) else X.take(index)


def row_hashes(source: Rows, prefix: bytes = b"") -> list:
    """A SHA-256 per row, fed ``prefix`` then the row's bytes block by block (one pass)."""
    hashes = [hashlib.sha256(prefix) for _ in range(source.n)]
    for _, block in source.blocks():
        block = block.cpu()
        for i, h in enumerate(hashes):
            h.update(block[i].numpy())
    return hashes


def validated(X: Rows) -> Rows:
    """``X`` marked as known finite (a shallow copy: the caller's source is not changed)."""
    out = copy.copy(X)
    out.validated = True
    return out


def as_rows(X: torch.Tensor | Rows) -> Rows:
    """``X`` as a source: a :class:`Rows` is returned as it is, a tensor wrapped in :class:`Memory`."""
    return X if isinstance(X, Rows) else Memory(X)


def windows(rows: Rows, size: int) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """The blocks of ``rows`` in consecutive lists of at most ``size``: work for ``size``
    threads that never holds more than ``size`` blocks at once."""
    batch: list[tuple[int, torch.Tensor]] = []
    for item in rows.blocks():
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def npy_header(path: str | Path) -> tuple[int, tuple[int, ...], np.dtype]:
    """``(data offset, shape, dtype)`` of a ``.npy`` file of a 1-D little-endian float array."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        offset = f.tell()
    if len(shape) != 1 or fortran or dtype not in (np.dtype("<f4"), np.dtype("<f8")):
        raise ValueError(f"{path}: a spooled row is a 1-D float32 or float64 array (got {dtype} {shape})")
    return offset, shape, dtype


def write_row(path: str | Path | BinaryIO, row: torch.Tensor) -> None:
    """Write ``row`` (1-D) as a ``.npy`` file that :class:`Spooled` reads (to a path or an
    open binary file)."""
    np.save(path, row.detach().cpu().contiguous().numpy(), allow_pickle=False)


class Scratch:
    """One buffer of ``dtype`` on ``device`` that blocks are copied into in turn (grown when a
    block is larger than any before): what :meth:`Rows.read` hands out."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(0, dtype=dtype, device=device)

    def copy(self, view: torch.Tensor) -> torch.Tensor:
        """``view``'s values converted to the buffer's dtype, as a contiguous tensor over the
        buffer's first ``view.numel()`` elements."""
        if view.numel() > self.buffer.numel():
            self.buffer = torch.empty(view.numel(), dtype=self.buffer.dtype, device=self.buffer.device)
        return self.buffer[: view.numel()].view(view.shape).copy_(view)


def _packed(block: torch.Tensor) -> torch.Tensor:
    """A new contiguous copy of ``block``: every source hands out blocks of one layout."""
    return block.clone(memory_format=torch.contiguous_format)
