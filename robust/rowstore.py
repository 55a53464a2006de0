"""A content-addressed folder of ``(d,)`` rows: where rules keep their state across rounds on disk.

A rule that follows nodes across rounds (FoolsGold's histories, FLDetector's last rows and
L-BFGS pairs) keeps ``(d,)`` vectors per node; at ``n = 64``, ``d = 1e8`` that is 25.6 GB, so a
run whose rows are spooled keeps them here instead (``robust.row_keeper``). Each row is one file
``<sha256>.npy`` in the format :class:`robust.source.Spooled` reads, named by
``robust.params.sha256`` of the row (dtype and shape included), like the audit's
``updates/<sha256>.npy``. A row is written block by block as it is computed
(:class:`StreamedRow`: header first, each block hashed as it is written, fsync, atomic rename),
so a new row is never whole in memory: memory is one block per row being written.

A state names its rows by their SHA-256 (:func:`reference`: 32 bytes as a ``uint8`` tensor).
Rows no state names any more are removed by :meth:`RowStore.collect`, which the owner calls
only once the checkpoint that stopped naming them is written: the checkpoint before it stays
loadable if the process dies mid-round. A row is checked (present, a whole ``(d,)`` row) when a
state names it and before it is read; its content is not hashed again on every read.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from .params import hash_prefix
from .source import npy_header

REF_BYTES = 32  # a reference is the row's SHA-256


def reference(sha: str) -> torch.Tensor:
    """The state entry that names the stored row ``sha``: its 32 bytes as a ``uint8`` tensor."""
    return torch.tensor(list(bytes.fromhex(sha)), dtype=torch.uint8)


def is_reference(value: torch.Tensor) -> bool:
    """Whether a state entry names stored rows (``uint8`` of last dimension 32) rather than holding them."""
    return value.dtype == torch.uint8 and value.dim() >= 1 and value.shape[-1] == REF_BYTES


def sha_of(value: torch.Tensor) -> str:
    """The SHA-256 a ``(32,)`` reference names."""
    if value.dtype != torch.uint8 or tuple(value.shape) != (REF_BYTES,):
        raise ValueError(f"a stored row's reference is 32 uint8 bytes (got {value.dtype} {tuple(value.shape)}): "
                         "the state is damaged; restore the checkpoint from a backup")
    return bytes(value.tolist()).hex()


def names(state: object) -> set[str]:
    """The SHA-256 of every row a (nested) state names: what :meth:`RowStore.collect` keeps."""
    if isinstance(state, dict):
        return set().union(*(names(v) for v in state.values()))
    if isinstance(state, (list, tuple)):
        return set().union(*(names(v) for v in state))
    if isinstance(state, torch.Tensor) and is_reference(state):
        return {sha_of(row) for row in state.reshape(-1, REF_BYTES)}
    return set()


class RowStore:
    """The folder ``folder`` of rows ``<sha256>.npy`` (made when the first row is written)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, sha: str) -> Path:
        return self.folder / f"{sha}.npy"

    def writer(self, d: int, dtype: torch.dtype) -> StreamedRow:
        """A new ``(d,)`` row of ``dtype``, to be written block by block."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return StreamedRow(self, d, dtype)

    def check(self, sha: str) -> Path:
        """The path of the row ``sha``, once it is known to be there whole; ``ValueError``
        saying what to do otherwise."""
        path = self.path(sha)
        try:
            offset, shape, dtype = npy_header(path)
            whole = path.stat().st_size == offset + shape[0] * dtype.itemsize
            why = "" if whole else "is cut short or too long in"
        except FileNotFoundError:
            why = "is missing from"
        except (OSError, ValueError) as err:
            why = f"does not load ({type(err).__name__}) in"
        if why:
            raise ValueError(f"rule state row {sha[:12]} {why} {self.folder}: the folder changed since the checkpoint "
                             f"that names it ({path.name}) was written; restore {self.folder} together with that "
                             "checkpoint from a backup, or start the run over in a new folder")
        return path

    def collect(self, referenced: set[str]) -> list[str]:
        """Remove every row not in ``referenced`` (and the temporary files of writes a crash
        cut short); returns the SHA-256 of the rows removed. Call it only once a checkpoint
        that names exactly ``referenced`` is written."""
        if not self.folder.exists():
            return []
        removed = []
        for path in self.folder.iterdir():
            if path.suffix == ".tmp" or (path.suffix == ".npy" and path.stem not in referenced):
                path.unlink(missing_ok=True)
                removed += [path.stem] if path.suffix == ".npy" else []
        return sorted(removed)

    def sync(self) -> None:
        """Make the renames of the rows written so far durable (fsync of the folder)."""
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class StreamedRow:
    """One ``(d,)`` row written to a :class:`RowStore` block by block: the ``.npy`` header of
    shape ``(d,)`` first (the bytes ``robust.source.write_row`` writes), then each block as it
    is :meth:`add`-ed, hashed as it goes; :meth:`finish` renames it to ``<sha256>.npy``."""

    def __init__(self, store: RowStore, d: int, dtype: torch.dtype) -> None:
        self.store, self.d, self.written = store, d, 0
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        fd, self.tmp = tempfile.mkstemp(dir=store.folder, suffix=".tmp")
        self.file = os.fdopen(fd, "wb")
        header = {"descr": np.lib.format.dtype_to_descr(np_dtype), "fortran_order": False, "shape": (d,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        self.hash = hashlib.sha256(hash_prefix(dtype, (d,)))  # robust.params.sha256 of the row

    def add(self, values: torch.Tensor) -> None:
        """Append the next values (1-D) of the row."""
        data = values.detach().cpu().contiguous().numpy()
        self.hash.update(data)
        self.file.write(data.data)
        self.written += data.shape[0]

    def finish(self) -> str:
        """Close the row (fsync) and file it under its SHA-256, which it returns (a row
        already there is the same bytes: the new copy is dropped)."""
        if self.written != self.d:
            self.abort()
            raise ValueError(f"a stored row got {self.written} of its {self.d} values (a rule's error)")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        sha = self.hash.hexdigest()
        if self.store.path(sha).exists():
            os.unlink(self.tmp)
        else:
            os.replace(self.tmp, self.store.path(sha))
        return sha

    def abort(self) -> None:
        """Drop the row being written."""
        self.file.close()
        Path(self.tmp).unlink(missing_ok=True)
