"""The ``(d,)`` rows a rule keeps from one call to the next: in memory, or in a row store on disk.

A rule that follows nodes (FoolsGold, FLDetector) holds *handles* to its rows and asks its
:class:`Keeper` for everything else: a handle is the row itself (a tensor) when the keeper has
no store, or the row's SHA-256 in a :class:`robust.rowstore.RowStore` once the rule was told to
:meth:`~Keeper.spill` there. The two kinds are read the same way (:meth:`Keeper.source`: a
:class:`Listed` source or a :class:`robust.source.Spooled` one, the same blocks value for
value) and written the same way (:meth:`Keeper.writing`: new rows filled block by block as
they are computed), so one code path gives the same bits from either. Memory: with a store,
one block per row being read or written; without, the rows themselves.

In a state (``Stage.state``) a handle is the row (no store) or a 32-byte reference to it
(``robust.rowstore.reference``); :meth:`Keeper.load` takes either, so a checkpoint written
without a store resumes with one (its rows are written to the store) and a checkpoint with a
store stays 32 bytes a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from .rowstore import RowStore, StreamedRow, is_reference, reference, sha_of
from .source import BLOCK, Rows, Spooled, npy_header

Handle = torch.Tensor | str  # a row in memory, or the SHA-256 of a row in the keeper's store


class Listed(Rows):
    """``(d,)`` tensors of one dtype as the rows of a source: each block stacked from their
    slices, nothing copied whole."""

    def __init__(self, rows: Sequence[torch.Tensor]) -> None:
        self.rows = list(rows)
        self.n, self.d = len(self.rows), self.rows[0].shape[0]
        self.dtype, self.device = self.rows[0].dtype, self.rows[0].device

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s in range(0, self.d, BLOCK):
            yield s, torch.stack([row[s : s + BLOCK] for row in self.rows])

    def row(self, i: int) -> torch.Tensor:
        return self.rows[i].clone()


def lockstep(*sources: Rows) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """``(start, [the block of each source])``: sources of one ``d`` read block by block together."""
    for items in zip(*(source.blocks() for source in sources), strict=True):
        yield items[0][0], [block for _, block in items]


def rows_of(block: torch.Tensor, index: list[int]) -> torch.Tensor:
    """The rows ``index`` of ``block``: ``block`` itself when that is all of them in order (no copy)."""
    return block if index == list(range(block.shape[0])) else block[index]


class Joined(Rows):
    """Rows computed block by block from several sources read together: ``fn(start, blocks)``
    is the ``(n, b)`` block of the new rows, ``blocks`` one block of each source."""

    def __init__(self, sources: Sequence[Rows], fn: Callable[[int, list[torch.Tensor]], torch.Tensor],
                 n: int, dtype: torch.dtype) -> None:
        self.sources, self.fn = list(sources), fn
        self.n, self.d, self.dtype, self.device = n, self.sources[0].d, dtype, self.sources[0].device

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for s, blocks in lockstep(*self.sources):
            yield s, self.fn(s, blocks)


class _Filled:
    """A new ``(d,)`` tensor filled block by block (a row kept in memory)."""

    def __init__(self, d: int, dtype: torch.dtype, device: torch.device) -> None:
        self.row, self.written = torch.empty(d, dtype=dtype, device=device), 0

    def add(self, values: torch.Tensor) -> None:
        self.row[self.written : self.written + values.shape[0]] = values
        self.written += values.shape[0]

    def finish(self) -> torch.Tensor:
        return self.row

    def abort(self) -> None:
        pass


class Writing:
    """``n`` new rows written block by block (:meth:`add` the next ``(n, b)`` columns);
    ``handles`` once :meth:`Keeper.writing` has finished them."""

    def __init__(self, sinks: list[_Filled | StreamedRow]) -> None:
        self.sinks, self.handles = sinks, []

    def add(self, block: torch.Tensor) -> None:
        for sink, values in zip(self.sinks, block, strict=True):
            sink.add(values)


class Keeper:
    """Where a rule keeps its rows: in memory (``store`` None) or in ``store``."""

    def __init__(self, store: RowStore | None = None) -> None:
        self.store = store

    def source(self, handles: Sequence[Handle], device: torch.device | str = "cpu") -> Rows:
        """The rows of ``handles`` (at least one, one dtype) as a source, in that order (rows
        read from the store are handed out on ``device``)."""
        if self.store is None:
            return Listed(handles)
        return Spooled([self.store.check(h) for h in handles], validated=True, device=device, shas=handles)

    @contextmanager
    def writing(self, n: int, d: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Iterator[Writing]:
        """``n`` new ``(d,)`` rows to fill in the ``with`` body; their handles are in
        ``.handles`` after it (rows being written when it raises are dropped)."""
        sinks = [self.store.writer(d, dtype) if self.store else _Filled(d, dtype, torch.device(device))
                 for _ in range(n)]
        out = Writing(sinks)
        try:
            yield out
            out.handles = [sink.finish() for sink in sinks]
        except BaseException:
            for sink in sinks:
                sink.abort()
            raise
        if self.store is not None:
            self.store.sync()

    def keep(self, row: torch.Tensor) -> Handle:
        """A handle to a copy of ``row`` (1-D), kept the keeper's way."""
        with self.writing(1, row.shape[0], row.dtype, row.device) as out:
            for s in range(0, row.shape[0], BLOCK):
                out.add(row[None, s : s + BLOCK])
        return out.handles[0]

    def size(self, handle: Handle) -> tuple[int, torch.dtype]:
        """``(d, dtype)`` of the row of ``handle``."""
        if isinstance(handle, torch.Tensor):
            return handle.shape[0], handle.dtype
        _, shape, dtype = npy_header(self.store.check(handle))
        return shape[0], torch.from_numpy(np.empty(0, dtype=dtype)).dtype

    def state(self, handle: Handle) -> torch.Tensor:
        """The state entry of ``handle``: the row itself, or its 32-byte reference."""
        return handle if isinstance(handle, torch.Tensor) else reference(handle)

    def load(self, value: torch.Tensor) -> Handle:
        """The handle of a state entry (a row or a reference), kept the keeper's way."""
        if not is_reference(value):
            return value if self.store is None else self.keep(value)
        if self.store is None:
            raise ValueError("the state names rule rows kept on disk (a run whose rows were spooled), and this rule "
                             "keeps its rows in memory: resume with the rule's row store (spool = disk)")
        sha = sha_of(value)
        self.store.check(sha)
        return sha

    def spill(self, store: RowStore) -> None:
        """Keep new rows in ``store`` from now on (the owner reloads its handles: :meth:`load`
        writes the rows it holds in memory there)."""
        if self.store is not None and self.store.folder != store.folder:
            raise ValueError(f"this rule keeps its rows in {self.store.folder} already: build a new aggregator "
                             f"to keep them in {store.folder}")
        self.store = store
