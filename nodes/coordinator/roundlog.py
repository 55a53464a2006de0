"""The round log's hash chain: each line of ``rounds.jsonl`` carries ``prev``, the SHA-256 of
the previous line's bytes (the first: of ``robust-audit/v1|<run id>``), so a changed, removed
or reordered line breaks the chain where it changed. Written by the coordinator, checked by
``robust audit verify`` (``nodes.coordinator.audit``) and the dashboard; no PyTorch here, so
that the coordinator's supervisor reads the log without it."""

from __future__ import annotations

import hashlib
import json

from .. import checkpoint


def genesis(run_id: str) -> str:
    return hashlib.sha256(f"robust-audit/v1|{run_id}".encode()).hexdigest()


def line_hash(record: dict) -> str:
    """SHA-256 of the log line that holds ``record``."""
    return hashlib.sha256(checkpoint.line(record).encode()).hexdigest()


def chain(run_id: str, data: bytes, word: str = "round") -> tuple[list[dict], list[tuple[int, str]], str]:
    """The hash chain of the round log ``data``: its records, its broken links (the line that
    changed, and the problem in words), and the SHA-256 of its last line. A line that is not
    JSON ends the records there (its problem last)."""
    records, broken, tip = [], [], genesis(run_id)
    for k, line in enumerate(data.splitlines(), start=1):
        try:
            record = json.loads(line)
        except ValueError:
            return records, [*broken, (k, f"{word} {k}: line {k} of {checkpoint.ROUNDS} is not JSON (changed)")], tip
        if record.get("prev") != tip:
            changed = k - 1 if k > 1 else k
            broken.append((changed, f"{word} {changed}: the record does not hash to what {word} {k} chains to "
                                    f"({checkpoint.ROUNDS} line {changed} changed)"))
        tip = hashlib.sha256(line).hexdigest()
        records.append(record)
    return records, broken, tip
