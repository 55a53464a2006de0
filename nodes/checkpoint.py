"""Files the coordinator keeps in its folder, written so that a crash never loses them.

``checkpoint.pt`` is replaced atomically each round (temporary file, fsync, rename, fsync of
the folder), so a process killed at any instant leaves either the old or the new checkpoint.
``rounds.jsonl`` gets one line per round, flushed and fsynced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CHECKPOINT, ROUNDS, RESULT, FAILED = "checkpoint.pt", "rounds.jsonl", "result.json", "failed.txt"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file, then move it over ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        write(out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save(folder: Path, state: dict) -> None:
    write_atomic(folder / CHECKPOINT, lambda out: torch.save(state, out))


def load(folder: Path) -> dict | None:
    path = folder / CHECKPOINT
    return torch.load(path, weights_only=True) if path.exists() else None


def rounds_done(folder: Path) -> int:
    """How many rounds the checkpoint in ``folder`` holds (0 without one)."""
    state = load(folder)
    return int(state["engine"]["round"]) if state else 0


def append_round(folder: Path, record: dict) -> None:
    with open(folder / ROUNDS, "a") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


def write_result(folder: Path, result: dict) -> None:
    write_atomic(folder / RESULT, lambda out: out.write((json.dumps(result, indent=1) + "\n").encode()))


def write_failure(folder: Path, err: BaseException) -> None:
    """Why the ServerApp could not run, for ``robust coordinator start`` to print."""
    write_atomic(folder / FAILED, lambda out: out.write(f"{type(err).__name__}: {err}\n".encode()))
