"""Text corpora as next-byte prediction sets: the Python standard library's own source, or a
user's folder of text files; never downloaded.

- ``pystdlib``: the running interpreter's standard library (``sysconfig``'s ``stdlib`` path),
  every ``.py`` file except those under a folder named ``test``, ``tests``, ``idle_test``,
  ``site-packages``, ``dist-packages`` or ``__pycache__``, the build's own configuration
  (``_sysconfigdata_*.py``, ``config-*/``), in sorted path order. Python 3.11 on Linux: 732 files,
  12.1 MB. Another Python version (or build) is another corpus, with another identity (below).
- ``text``: every regular file under ``data-root`` (recursively, sorted; hidden files and
  folders, and files holding a NUL byte, i.e. binary, left out).

**Tokens are bytes** (a vocabulary of 256): nothing to download or train, every text and
language represented exactly, and a model's parameters stay a function of its spec. A
trained tokenizer (BPE) would shorten sequences about 3-4x, but its vocabulary is a file that
would have to be fetched or trained and pinned, and volunteers would have to hold the same
one; bytes need nothing.

**Samples.** Each file's bytes are cut into non-overlapping windows of ``context + 1`` bytes
(the tail shorter than that is dropped); a sample is the first ``context`` bytes (``x``,
``uint8``) and its targets the last ``context`` (``y``, the next byte at each position, int64).
The model turns bytes into embeddings (``robust.gpt``); the targets are class indices for the
cross-entropy.

**Held-out files.** A file is held out when the first byte of the SHA-256 of its relative
path is below 26 (about 10% of the files, the same on every machine and seed: a split by
file, so no held-out text was seen in training). The evaluation set is :data:`EVAL_BYTES` bytes
of windows spread evenly over the held-out ones (512 windows at context 64, 128 at 256: every
round evaluates on it, and a forward pass costs in proportion to its bytes: ``eval_bytes``
sets it, ``pystdlib:context=128,eval_bytes=8192``).

**Groups.** Each training window records the package it came from (the first component of
its relative path: ``asyncio``, ``email``, or a top-level module), so the label-skew
partitions split text by package (``dirichlet``: each node's share of each package drawn from
a Dirichlet; ``label-shards``: each node gets a few packages): a non-IID split by what the
code is about. ``iid`` deals windows at random.

**Identity.** A corpus is its name and the SHA-256 of its content (each file's relative path
and bytes, in order, and the context): ``Corpus.sha256``. Tasks carry it, and a volunteer
whose corpus differs declines with the reason instead of training on other data.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SETS = ("pystdlib", "text")
CONTEXT = 64  # bytes a sample holds by default (the gpt-tiny context)
EVAL_BYTES = 32_768  # held-out bytes evaluated each round (at least 16 windows)
HELD_OUT_BELOW = 26  # a file is held out when its path's SHA-256 starts with a byte below this (~10%)
VOCAB = 256
SKIPPED_FOLDERS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """A text set as windows: ``x`` ``(N, context)`` uint8, ``y`` ``(N, context)`` uint8 (bytes,
    as the loss takes them widened a batch at a time: int64 targets for the whole of
    ``pystdlib`` took 82 MB of every process that loads it), the training windows' package
    ``groups`` ``(N,)``, and its identity."""

    x_train: np.ndarray
    y_train: np.ndarray
    groups: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    sha256: str
    files: int
    bytes: int


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's root and the ``.py`` files ``pystdlib`` takes (see above)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_FOLDERS & set(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if rel.name.startswith("_sysconfigdata_") or not path.is_file():
            continue
        files.append(path)
    return root, files


def folder_files(root: Path) -> list[Path]:
    """The text files ``text`` takes from ``root`` (see above)."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if b"\0" in path.read_bytes():
            continue
        files.append(path)
    return files


def held_out(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < HELD_OUT_BELOW


def corpus(name: str, root: Path | None, context: int = CONTEXT, eval_bytes: int = EVAL_BYTES) -> Corpus:
    """The text set ``name`` (``pystdlib``, or ``text`` from the folder ``root``) as windows of
    ``context`` bytes, ``eval_bytes`` of them held out for evaluation; ``ValueError`` says what
    is missing."""
    if name == "pystdlib":
        base, files = stdlib_files()
    elif root is None:
        raise ValueError("dataset text reads your text files from a folder: set data-root = DIR "
                         "(scenario key, or robust bench --set data-root=DIR)")
    elif not root.is_dir():
        raise ValueError(f"dataset text: data-root {root} is not a folder: point it at your text files")
    else:
        base, files = root, folder_files(root)
    digest = hashlib.sha256(f"robust-text/v1|{name}|context={context}".encode()
                            + (f"|eval_bytes={eval_bytes}".encode() if eval_bytes != EVAL_BYTES else b""))
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    groups: list[int] = []
    packages: dict[str, int] = {}
    total = 0
    for path in files:
        rel = path.relative_to(base).as_posix()
        data = path.read_bytes()
        digest.update(f"|{rel}|{len(data)}|".encode())
        digest.update(data)
        total += len(data)
        windows = np.frombuffer(data, np.uint8)[: len(data) // (context + 1) * (context + 1)].reshape(-1, context + 1)
        if held_out(rel):
            test.append(windows)
        else:
            train.append(windows)
            groups += [packages.setdefault(rel.split("/")[0].removesuffix(".py"), len(packages))] * len(windows)
    train_w = np.concatenate(train) if train else np.zeros((0, context + 1), np.uint8)
    test_w = np.concatenate(test) if test else np.zeros((0, context + 1), np.uint8)
    if not len(train_w) or not len(test_w):
        raise ValueError(f"dataset {name}: {len(files)} files ({total} bytes) give {len(train_w)} training and "
                         f"{len(test_w)} held-out windows of {context + 1} bytes; about 10% of the files are held "
                         "out, by path: give it more (or longer) files, or a shorter context")
    windows = max(16, eval_bytes // context)
    pick = np.linspace(0, len(test_w) - 1, min(windows, len(test_w))).round().astype(np.int64)
    test_w = test_w[pick]
    return Corpus(train_w[:, :-1].copy(), train_w[:, 1:].copy(), np.asarray(groups, np.int64),
                  test_w[:, :-1].copy(), test_w[:, 1:].copy(), digest.hexdigest(), len(files), total)
