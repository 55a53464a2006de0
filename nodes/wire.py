"""What crosses the wire between coordinator and volunteer, and the bytes a volunteer signs.

A task carries the global model as one flat float32 array plus the round's settings; a reply
carries the update row plus ``(run, round, base, count, signature)``. Conversions to and from
Flower's ``RecordDict`` live here and nowhere else. Decoding a reply raises ``ValueError``
with the reason for *anything* malformed: the caller turns it into a rejection, never a crash.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

MODEL, TASK, UPDATE, REPLY = "model", "task", "update", "reply"


@dataclass(frozen=True)
class Task:
    run: str            # the federation's run id (stable across coordinator restarts)
    round: int
    base: str           # SHA-256 of the model sent (see robust.params.sha256)
    seed: int
    dataset: str
    model: str
    protocol: str       # nodes.protocol spec: what the row is
    batch_size: int
    lr: float
    momentum: float
    threads: int        # the compute profile: CPU threads (robust.compute)

    @classmethod
    def of(cls, settings, run: str, round: int, base: str) -> Task:
        """Round ``round``'s task under ``settings`` (``nodes.settings.Settings``)."""
        s = settings
        return cls(run=run, round=round, base=base, seed=s.seed, dataset=s.dataset, model=s.model,
                   protocol=s.protocol, batch_size=s.batch_size, lr=s.lr, momentum=s.momentum, threads=s.threads)


@dataclass(frozen=True)
class Reply:
    run: str
    round: int
    base: str
    count: int          # samples the node says it trained on: capped and logged, never a weight
    signature: bytes
    refused: str = ""   # non-empty: the node declined the work, and why
    seconds: float = 0.0  # the node's own training time (not signed: for overhead figures only)


def signed_payload(run: str, round: int, base: str, update_sha: str, count: int) -> bytes:
    """The exact bytes a volunteer signs and the coordinator verifies."""
    return f"robust-update/v1|{run}|{round}|{base}|{update_sha}|{count}".encode()


def task_content(task: Task, w: np.ndarray) -> RecordDict:
    return RecordDict({MODEL: ArrayRecord({"w": Array(w)}), TASK: ConfigRecord(asdict(task))})


def read_task(content: RecordDict) -> tuple[Task, np.ndarray]:
    """Decode a task; ``ValueError`` says what is missing (a coordinator of another version)."""
    try:
        config = content.config_records[TASK]
        task = Task(**{f.name: config[f.name] for f in fields(Task)})
        return task, content.array_records[MODEL]["w"].numpy()
    except KeyError as err:
        raise ValueError(f"the task lacks {err}: is the coordinator's robust version the same as this node's?") from None


def reply_content(reply: Reply, row: np.ndarray | None) -> RecordDict:
    records: dict = {REPLY: ConfigRecord(asdict(reply))}
    if row is not None:
        records[UPDATE] = ArrayRecord({"row": Array(row)})
    return RecordDict(records)


_TYPES = {"run": str, "round": int, "base": str, "count": int, "signature": bytes, "refused": str, "seconds": float}


def read_reply(content: RecordDict) -> tuple[Reply, np.ndarray | None]:
    """Decode a reply; ``ValueError`` says what is malformed."""
    try:
        config = content.config_records[REPLY]
    except KeyError:
        raise ValueError("no reply record") from None
    values = {}
    for name, kind in _TYPES.items():
        value = config.get(name)
        if type(value) is not kind:
            raise ValueError(f"reply field {name!r} missing or not {kind.__name__}")
        values[name] = value
    reply = Reply(**values)
    if reply.refused:
        return reply, None
    try:
        record = content.array_records[UPDATE]
        array = record["row"]
    except KeyError:
        raise ValueError("no update array") from None
    if array.dtype != "float32":
        raise ValueError(f"update dtype {array.dtype}, expected float32")
    try:
        row = array.numpy()
    except Exception as err:  # noqa: BLE001 - untrusted bytes: any decoder failure is a rejection
        raise ValueError(f"update does not decode ({type(err).__name__})") from None
    return reply, row


# Introductions: a node that Flower did not authenticate (a simulated one) says who it is.
INTRODUCE, IDENTITY = "introduce", "identity"


def introduction_content(run: str) -> RecordDict:
    return RecordDict({INTRODUCE: ConfigRecord({"run": run})})


def read_introduction(content: RecordDict) -> str | None:
    """The run a node is asked to introduce itself for, or ``None`` (not an introduction)."""
    record = content.config_records.get(INTRODUCE)
    return None if record is None else str(record["run"])


def identity_content(public_key: bytes) -> RecordDict:
    return RecordDict({IDENTITY: ConfigRecord({"public-key": public_key})})


def read_identity(content: RecordDict) -> bytes:
    """The public key (OpenSSH line) a node introduced itself with; ``ValueError`` if none."""
    try:
        value = content.config_records[IDENTITY]["public-key"]
    except KeyError:
        raise ValueError("no identity record") from None
    if type(value) is not bytes:
        raise ValueError("identity is not bytes")
    return value
