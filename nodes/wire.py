"""What crosses the wire between coordinator and volunteer, and the bytes a volunteer signs.

A task carries the global model as one flat float32 array plus the round's settings; a reply
carries the update row plus ``(run, round, base, count, signature)``. Conversions to and from
Flower's ``RecordDict`` live here and nowhere else. Decoding a reply raises ``ValueError``
with the reason for *anything* malformed: the caller turns it into a rejection, never a crash.

A reply's update is checked for what its bytes *are*, not what its labels say: the byte
count against a cap derived from the model first, then the ``.npy`` header's dtype and shape,
and only then one read of the values, as little-endian float32 (a node cannot make the
coordinator decode, copy or hold more than one model's worth of values, nor change the
model's dtype or shape).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import io
import json
import math

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
    deadline: float     # seconds the coordinator waits for replies this round

    @classmethod
    def of(cls, settings, run: str, round: int, base: str) -> Task:
        """Round ``round``'s task under ``settings`` (``nodes.settings.Settings``)."""
        s = settings
        return cls(run=run, round=round, base=base, seed=s.seed, dataset=s.dataset, model=s.model,
                   protocol=s.protocol, batch_size=s.batch_size, lr=s.lr, momentum=s.momentum, threads=s.threads,
                   deadline=s.deadline)


@dataclass(frozen=True)
class Reply:
    run: str
    round: int
    base: str
    count: int          # samples the node says it trained on: capped and logged, never a weight
    signature: bytes
    refused: str = ""   # non-empty: the node declined the work, and why
    seconds: float = 0.0  # the node's own training time (not signed: for overhead figures only)
    part: str = ""      # the data the update was computed on: part I/N of the data set
    profile: str = ""   # the compute profile it ran on (nodes.spotcheck.profile_of)
    author: str = ""    # a spot check: the node whose update this recomputes ("" for own work)


def signed_payload(run: str, round: int, base: str, update_sha: str, count: int, part: str = "",
                   profile: str = "", author: str = "") -> bytes:
    """The exact bytes a volunteer signs and the coordinator (and an auditor) verifies: a
    JSON list, so no field's text can pass for another field's."""
    fields_ = [run, round, base, update_sha, count, part, profile, author]
    return b"robust-update/v2" + json.dumps(fields_, ensure_ascii=True).encode()


def reply_payload(reply: Reply, update_sha: str) -> bytes:
    """What ``reply`` signed, for an update of SHA-256 ``update_sha``."""
    return signed_payload(reply.run, reply.round, reply.base, update_sha, reply.count, reply.part, reply.profile,
                          reply.author)


CHECK = "check"  # a spot check: recompute the task of node `author` on its data `part`


def task_content(task: Task, w: np.ndarray, check: tuple[str, str] | None = None) -> RecordDict:
    """A task; with ``check = (author, part)``, the task of a spot check of ``author``'s update."""
    records = {MODEL: ArrayRecord({"w": Array(w)}), TASK: ConfigRecord(asdict(task))}
    if check is not None:
        records[CHECK] = ConfigRecord({"author": check[0], "part": check[1]})
    return RecordDict(records)


def read_task(content: RecordDict) -> tuple[Task, np.ndarray, tuple[str, str] | None]:
    """Decode a task: ``(task, model, (author, part) of a spot check or None)``; ``ValueError``
    says what is missing (a coordinator of another version)."""
    try:
        config = content.config_records[TASK]
        task = Task(**{f.name: config[f.name] for f in fields(Task)})
        check = content.config_records.get(CHECK)
        check = None if check is None else (str(check["author"]), str(check["part"]))
        return task, content.array_records[MODEL]["w"].numpy(), check
    except KeyError as err:
        raise ValueError(f"the task lacks {err}: is the coordinator's robust version the same as this node's?") from None


def reply_content(reply: Reply, row: np.ndarray | None) -> RecordDict:
    records: dict = {REPLY: ConfigRecord(asdict(reply))}
    if row is not None:
        records[UPDATE] = ArrayRecord({"row": Array(row)})
    return RecordDict(records)


_TYPES = {"run": str, "round": int, "base": str, "count": int, "signature": bytes, "refused": str, "seconds": float,
          "part": str, "profile": str, "author": str}
_OPTIONAL = {"part": "", "profile": "", "author": ""}  # absent: empty (a node that declares none)
FIELD_CAP = 4096  # bytes: the longest text or signature a reply field may hold
HEADER_CAP = 1024  # bytes: the longest .npy header of a one-dimensional float32 array
ROW_DTYPE = np.dtype("<f4")


def read_reply(content: RecordDict, d: int) -> tuple[Reply, np.ndarray | None]:
    """Decode a reply whose update must be ``d`` float32 values; ``ValueError`` says what is
    malformed. The row is read-only (it views the message's bytes)."""
    try:
        config = content.config_records[REPLY]
    except KeyError:
        raise ValueError("no reply record") from None
    values = {}
    for name, kind in _TYPES.items():
        value = config.get(name, _OPTIONAL.get(name))
        if type(value) is not kind:
            raise ValueError(f"reply field {name!r} missing or not {kind.__name__}")
        if isinstance(value, (str, bytes)) and len(value) > FIELD_CAP:
            raise ValueError(f"reply field {name!r} holds {len(value)} bytes, at most {FIELD_CAP} are read")
        values[name] = value
    if not (math.isfinite(values["seconds"]) and values["seconds"] >= 0):
        raise ValueError(f"reply field 'seconds' is {values['seconds']}, not a finite number >= 0")
    reply = Reply(**values)
    if reply.refused:
        return reply, None
    try:
        array = content.array_records[UPDATE]["row"]
    except KeyError:
        raise ValueError("no update array") from None
    return reply, read_row(array, d)


def read_row(array: Array, d: int) -> np.ndarray:
    """The ``(d,)`` float32 values in ``array``'s bytes, checked before they are decoded."""
    data = array.data
    if array.stype != "numpy.ndarray" or not isinstance(data, bytes):
        raise ValueError(f"update serialised as {str(array.stype)[:40]!r}, expected numpy.ndarray")
    if len(data) > d * ROW_DTYPE.itemsize + HEADER_CAP:
        raise ValueError(f"update is {len(data)} bytes, a model of {d} float32 values takes at most "
                         f"{d * ROW_DTYPE.itemsize + HEADER_CAP}")
    buffer = io.BytesIO(data)
    try:
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(buffer)]
        shape, _, dtype = read_header(buffer, max_header_size=HEADER_CAP)
    except Exception as err:  # noqa: BLE001 - untrusted bytes: any parser failure is a rejection
        raise ValueError(f"update bytes are not a .npy array ({type(err).__name__})") from None
    if dtype != ROW_DTYPE:
        raise ValueError(f"update bytes hold {dtype}, labelled {str(array.dtype)[:40]}: expected float32")
    if tuple(shape) != (d,):
        raise ValueError(f"update bytes hold shape {tuple(shape)}, expected ({d},)")
    try:
        labels = (str(array.dtype), tuple(int(n) for n in array.shape))
    except (TypeError, ValueError):
        labels = None
    if labels != ("float32", (d,)):
        raise ValueError(f"update labelled {str(labels)[:80]}, its bytes are float32 ({d},)")
    if len(data) - buffer.tell() != d * ROW_DTYPE.itemsize:
        raise ValueError(f"update holds {len(data) - buffer.tell()} value bytes, ({d},) float32 takes {d * ROW_DTYPE.itemsize}")
    return np.frombuffer(data, dtype=ROW_DTYPE, count=d, offset=buffer.tell())


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
