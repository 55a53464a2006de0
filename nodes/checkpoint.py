"""Files the coordinator keeps in its folder, written so that a crash never loses them.

``checkpoint.pt`` is replaced atomically each round (temporary file, fsync, rename, fsync of
the folder), so a process killed at any instant leaves either the old or the new checkpoint.
``rounds.jsonl`` gets one line per round, flushed and fsynced, after the checkpoint (which
also holds that line): a process killed between the two leaves a log one round short, which
:func:`load` completes. A checkpoint that does not load, is not one, or disagrees with the
log is refused with what to do (never a traceback, never a silent restart). JSON files never
hold a non-finite number.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

CHECKPOINT, ROUNDS, RESULT, FAILED = "checkpoint.pt", "rounds.jsonl", "result.json", "failed.txt"
RUN_ID = "run-id"  # the Flower run the folder's coordinator follows


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file, then move it over ``path`` atomically (a
    write that fails, a full disk say, leaves ``path`` as it was and no temporary file)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save(folder: Path, state: dict) -> None:
    import torch  # here, not above: the coordinator's supervisor reads this folder without PyTorch

    write_atomic(folder / CHECKPOINT, lambda out: torch.save(state, out))


def _start_over(folder: Path) -> str:
    return (f"restore {CHECKPOINT} and {ROUNDS} together from a backup, or move both out of {folder} "
            "to start the run over")


def load(folder: Path) -> dict | None:
    """The checkpoint in ``folder`` (``None``: a new run), with ``rounds.jsonl`` made to agree
    with it; ``ValueError`` saying what to do when the two cannot both be true."""
    import torch

    path, logged = folder / CHECKPOINT, _logged_rounds(folder)
    if not path.exists():
        if logged:
            raise ValueError(f"{folder / ROUNDS} records {logged} round(s) but {path} is missing: {_start_over(folder)}")
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, empty, random bytes: all the same to the user
        raise ValueError(f"{path} does not load ({type(err).__name__}): {_start_over(folder)}") from None
    try:
        done, record = int(state["engine"]["round"]), state["record"]
        if not isinstance(state["settings"], dict) or not isinstance(state["engine"]["w"], torch.Tensor):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path} is not a robust coordinator checkpoint: {_start_over(folder)}") from None
    if logged == done - 1 and isinstance(record, dict) and record.get("round") == done:
        append_round(folder, record)  # killed between the checkpoint and the log line
    elif logged != done:
        raise ValueError(f"{path} is at round {done} but {folder / ROUNDS} records {logged} round(s): {_start_over(folder)}")
    return state


def logged_lines(folder: Path) -> bytes:
    """The complete lines of ``folder``'s round log (none when it has none): a last line still
    being written, or cut by a crash, is left out. Never writes."""
    path = folder / ROUNDS
    data = path.read_bytes() if path.exists() else b""
    return data[: data.rfind(b"\n") + 1]


def _logged_rounds(folder: Path) -> int:
    """How many rounds ``rounds.jsonl`` records (a line cut by a crash is dropped)."""
    path = folder / ROUNDS
    if not path.exists():
        return 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # the process died writing this line
        data = data[: data.rfind(b"\n") + 1]
        write_atomic(path, lambda out: out.write(data))
    try:
        rounds = [json.loads(line)["round"] for line in data.decode().splitlines()]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a robust round log: {_start_over(folder)}") from None
    if rounds != list(range(1, len(rounds) + 1)):
        raise ValueError(f"{path} does not number its rounds 1, 2, 3...: {_start_over(folder)}")
    return len(rounds)


def finite(value: object) -> object:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN, no inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _json(value: object, **options) -> str:
    return json.dumps(finite(value), allow_nan=False, **options)


def line(record: dict) -> str:
    """The line of ``rounds.jsonl`` that holds ``record`` (what the audit chain hashes)."""
    return _json(record)


def append_round(folder: Path, record: dict) -> None:
    with open(folder / ROUNDS, "a") as out:
        out.write(line(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


def write_result(folder: Path, result: dict) -> None:
    write_atomic(folder / RESULT, lambda out: out.write((_json(result, indent=1) + "\n").encode()))


def write_failure(folder: Path, err: BaseException) -> None:
    """Why the ServerApp could not run, for ``robust coordinator start`` to print."""
    write_atomic(folder / FAILED, lambda out: out.write(f"{type(err).__name__}: {err}\n".encode()))
