"""Byzantine test nodes: ``robust node join --attack SPEC``.

Two families. Node-side attacks from ``attacks/`` (``label-flip``, ``backdoor:...``) poison the
node's data and scale its update; the reply is otherwise honest and correctly signed. Protocol
faults break the reply itself, each one a check the coordinator must make:

- ``nan``: the update holds NaN;            ``wrong-shape``: one value too many;
- ``huge-norm``: the update scaled by 1e6;  ``inflated-count``: claims 1e12 samples;
- ``bad-signature``: the signature is random bytes;
- ``replay``: re-sends its previous round's signed reply (the first round is honest);
- ``stale-base``: signs for a base model other than the one it was sent;
- ``dtype-lie``: float64 bytes labelled float32 (half the values: as many bytes as the honest update);
- ``shape-lie``: one value more than the label says;
- ``oversize``: an update 64 times the model's size;
- ``slow-drip``: replies a few seconds before the round's deadline;
- ``decline``: declines every task;
- ``trainer-crash``, ``trainer-hang``, ``trainer-garbage``: the node's warm trainer
  (``nodes.volunteer.trainer``) is killed (SIGKILL), stops answering, or answers bytes that are
  no answer, at its task of round 1; ``robust node join`` restarts it, and it answers the later
  rounds honestly;
- ``clientapp-stall``: at round 1, once the trainer answered, the task's ClientApp process
  stops (SIGSTOP, its heartbeat thread too) for longer than Flower's task heartbeat window,
  then goes on to push its reply, which the SuperNode no longer accepts: a reply lost to the
  runtime, which the node logs (``nodes.volunteer.runtime_watch``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, RecordDict

from ..wire import UPDATE, Reply, reply_content

PROTOCOL_FAULTS = ("nan", "wrong-shape", "huge-norm", "inflated-count", "bad-signature", "replay", "stale-base",
                   "dtype-lie", "shape-lie", "oversize", "slow-drip", "decline", "trainer-crash", "trainer-hang",
                   "trainer-garbage", "clientapp-stall")
REPLAY_FILE = "last-reply.npz"
DECLINE = "this node declines every task (test fault: decline)"
DRIP_MARGIN = 5.0  # seconds before the deadline a slow-drip node replies (a SuperNode polls every 3 s)


def corrupt_row(fault: str, row: np.ndarray) -> np.ndarray:
    """The update as the faulty node sends it (before signing)."""
    if fault == "nan":
        row = row.copy()
        row[0] = np.nan
    elif fault == "wrong-shape":
        row = np.append(row, np.float32(0))
    elif fault == "huge-norm":
        row = row * np.float32(1e6)
    return row


def corrupt_fields(fault: str, count: int, base: str) -> tuple[int, str]:
    """``(count, base)`` as the faulty node signs them."""
    if fault == "inflated-count":
        return 10**12, base
    if fault == "stale-base":
        return count, "0" * 64
    return count, base


def corrupt_reply(fault: str, reply: Reply, row: np.ndarray, folder: Path) -> tuple[Reply, np.ndarray]:
    """The signed reply as the faulty node sends it."""
    if fault == "bad-signature":
        return dataclasses.replace(reply, signature=os.urandom(len(reply.signature))), row
    if fault == "replay":
        path = folder / REPLAY_FILE
        saved = None
        if path.exists():
            with np.load(path, allow_pickle=False) as stored:  # read it all before overwriting
                saved = {k: stored[k] for k in stored.files}
        np.savez(path, row=row, run=reply.run, round=reply.round, base=reply.base, count=reply.count,
                 signature=np.frombuffer(reply.signature, dtype=np.uint8))
        if saved is not None:
            return Reply(run=str(saved["run"]), round=int(saved["round"]), base=str(saved["base"]),
                         count=int(saved["count"]), signature=saved["signature"].tobytes()), saved["row"]
    return reply, row


def content(fault: str, reply: Reply, row: np.ndarray | None) -> RecordDict:
    """The reply as the faulty node puts it on the wire (labels that lie about the bytes)."""
    out = reply_content(reply, row)
    if row is None or fault not in ("dtype-lie", "shape-lie", "oversize"):
        return out
    if fault == "oversize":
        out.array_records[UPDATE]["row"] = Array(np.tile(row, 64))
        return out
    sent = row[: len(row) // 2].astype(np.float64) if fault == "dtype-lie" else np.append(row, np.float32(0))
    data = io.BytesIO()
    np.save(data, sent, allow_pickle=False)
    out.array_records[UPDATE]["row"] = Array(dtype="float32", shape=row.shape, stype="numpy.ndarray", data=data.getvalue())
    return out


def delay(fault: str, sent_at: float, deadline: float) -> float:
    """Seconds the faulty node waits before replying to a task sent at ``sent_at`` (Unix time)."""
    return max(0.0, sent_at + deadline - DRIP_MARGIN - time.time()) if fault == "slow-drip" else 0.0


def trainer_fault(fault: str, round: int) -> str:
    """What the faulty node's trainer does at its task of ``round`` instead of answering:
    ``crash``, ``hang``, ``garbage``, or ``""`` (answer)."""
    return fault.removeprefix("trainer-") if fault.startswith("trainer-") and round == 1 else ""


def stalls_clientapp(fault: str, round: int) -> bool:
    """Whether the faulty node's ClientApp stalls past its heartbeat window at ``round``."""
    return fault == "clientapp-stall" and round == 1
