"""What crosses the wire between coordinator and volunteer, and the bytes a volunteer signs.

A task carries the global model as one flat float32 array plus the round's settings; a reply
carries the update plus ``(run, round, base, count, signature)``. The update travels as the
task's codec (``compression``, ``robust.codecs``) encodes it: with ``none`` one float32 array
``row`` (as before codecs existed); with any other codec, the codec's named arrays (``fp16``:
``x``; ``int8``: ``q``, ``scale``; ``topk`` / ``randk``: ``idx``, ``val``) in the same
``update`` record. The signature covers the SHA-256 of the *decoded* row, so the coordinator,
the log and the audit only ever see decoded float32 rows, whatever the codec. Conversions to and from
Flower's ``RecordDict`` live here and nowhere else. Decoding a reply raises ``ValueError``
with the reason for *anything* malformed: the caller turns it into a rejection, never a crash.

A reply's update is checked for what its bytes *are*, not what its labels say: the byte
count against a cap derived from the model first, then the ``.npy`` header's dtype and shape,
and only then one read of the values, as little-endian float32 (a node cannot make the
coordinator decode, copy or hold more than one model's worth of values, nor change the
model's dtype or shape). An encoded update is checked the same way, array by array, against
the exact names, dtypes and lengths an honest node sends (``codec.layout(d)``), before the
codec decodes it (``codec.decode``: a ``ValueError`` with the reason for anything malformed).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace

import io
import json
import math
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

if TYPE_CHECKING:  # codecs import torch; the volunteer's thin ClientApp reads and writes messages without it
    from robust.codecs import Codec, Encoded

MODEL, TASK, UPDATE, REPLY = "model", "task", "update", "reply"


@dataclass(frozen=True)
class Task:
    run: str            # the federation's run id (stable across coordinator restarts)
    round: int
    base: str           # SHA-256 of the model sent (see robust.params.sha256)
    seed: int
    dataset: str
    model: str
    protocol: str       # nodes.engine.protocol spec: what the row is
    batch_size: int
    lr: float
    momentum: float
    threads: int        # the compute profile: CPU threads (robust.compute)
    deadline: float     # seconds the coordinator waits for replies this round
    compression: str = "none"  # robust.codecs spec: how the node encodes its update
    late: bool = False  # an answer after the deadline still counts, until the message's TTL (carry, async)
    # the worker momentum the node continues from (``momentum`` with spot checks, nodes.engine.engine):
    # ZERO, or the SHA-256 of the node's last row the coordinator used; "" for its own, as it carries it
    state: str = ""
    data_sha256: str = ""  # the data set's identity where it has one (a text set's content, robust.text)
    # bytes the volunteer holds at once for it (model, training, gradient: Protocol.memory); 0: not said
    memory: int = 0

    @classmethod
    def of(cls, settings, run: str, round: int, base: str, data_sha256: str = "", memory: int = 0) -> Task:
        """Round ``round``'s task under ``settings`` (``nodes.settings.Settings``), on the data set
        whose identity is ``data_sha256`` where it has one, needing ``memory`` bytes where said."""
        s = settings
        return cls(run=run, round=round, base=base, seed=s.seed, dataset=s.dataset, model=s.model,
                   protocol=s.protocol, batch_size=s.batch_size, lr=s.lr, momentum=s.momentum, threads=s.threads,
                   deadline=s.deadline, compression=s.compression, late=s.stale_rows, data_sha256=data_sha256,
                   memory=memory)

    def continuing(self, state: str) -> Task:
        """This task for a node that continues from the momentum ``state`` names
        (``Engine.named_state``; ``""``: this task as it is)."""
        return replace(self, state=state) if state else self


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
    profile: str = ""   # the compute profile it ran on (nodes.engine.spotcheck.profile_of)
    author: str = ""    # a spot check: the node whose update this recomputes ("" for own work)
    root: str = ""      # the trajectory it commits to (nodes.engine.trajectory; "" where the protocol has none)


def refusal(task: Task, reason: str, author: str = "") -> Reply:
    """The reply of a node that declines ``task`` (a spot check of ``author``'s), saying why:
    nothing to sign, nothing to read."""
    return Reply(run=task.run, round=task.round, base=task.base, count=0, signature=b"", refused=reason,
                 author=author)


def signed_payload(run: str, round: int, base: str, update_sha: str, count: int, part: str = "",
                   profile: str = "", author: str = "", root: str = "") -> bytes:
    """The exact bytes a volunteer signs and the coordinator (and an auditor) verifies: a
    JSON list, so no field's text can pass for another field's."""
    fields_ = [run, round, base, update_sha, count, part, profile, author, root]
    return b"robust-update/v3" + json.dumps(fields_, ensure_ascii=True).encode()


def reply_payload(reply: Reply, update_sha: str) -> bytes:
    """What ``reply`` signed, for an update of SHA-256 ``update_sha``."""
    return signed_payload(reply.run, reply.round, reply.base, update_sha, reply.count, reply.part, reply.profile,
                          reply.author, reply.root)


CHECK = "check"  # a spot check: recompute the task of node `author` on its data `part`
# a dispute: answer with the states of the trajectory `root` this node committed to for the task
# of node `author` (itself, or the author whose update it recomputed) on its data `part`
DISPUTE, CLAIM = "dispute", "claim"


DOWNLINK_BYTES = {"none": 4, "fp16": 2}  # bytes per coordinate of the model a task carries


def model_array(w: np.ndarray, downlink: str) -> np.ndarray:
    """The model as a task carries it: float32, or with ``downlink = fp16`` the half-precision
    values of ``w`` (``w`` must already be rounded to them, ``Engine.task_model``: the cast
    is then exact, and the volunteer's float32 copy is ``w`` bit for bit)."""
    return w.astype(np.float16) if downlink == "fp16" else w


def npy_array(a: np.ndarray) -> Array:
    """Flower's ``Array(a)``, the ``.npy`` bytes ``np.save`` writes (a C-ordered array, its
    header version 1.0), made with one copy of ``a``'s bytes where Flower makes two at once (its
    buffer, then the buffer's value): 400 MB less at the peak of a 100M model's message."""
    a = np.ascontiguousarray(a)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(a))
    data = b"".join([head.getvalue(), memoryview(a).cast("B")])
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=data)


def model_record(w: np.ndarray) -> ArrayRecord:
    """The model array ``w`` as tasks carry it: one record for every task that carries ``w``
    (each ``Array`` is a serialized copy of the model in the ServerApp, while the SuperLink
    stores an object once per content hash: shared, ``n`` tasks cost one copy, not ``n``)."""
    return ArrayRecord({"w": npy_array(w)})


def task_content(task: Task, w: np.ndarray | ArrayRecord, check: tuple[str, str] | None = None,
                 dispute: str = "") -> RecordDict:
    """A task carrying the model ``w`` (or its :func:`model_record`, shared with other tasks);
    with ``check = (author, part)``, the task of a spot check of ``author``'s update; with a
    ``dispute`` root as well, a dispute: the node asked answers with the states of the
    trajectory it committed to with that root for that work (its own: ``author`` is itself)."""
    model = w if isinstance(w, ArrayRecord) else model_record(w)
    records = {MODEL: model, TASK: ConfigRecord(asdict(task))}
    if check is not None:
        records[DISPUTE if dispute else CHECK] = ConfigRecord({"author": check[0], "part": check[1],
                                                                **({"root": dispute} if dispute else {})})
    return RecordDict(records)


def task_of(content: RecordDict) -> Task:
    """A task's settings, without its model; ``ValueError`` as :func:`read_task`."""
    try:
        config = content.config_records[TASK]
        return Task(**{f.name: config[f.name] if f.default is MISSING else config.get(f.name, f.default)
                       for f in fields(Task)})
    except KeyError as err:
        raise ValueError(f"the task lacks {err}: is the coordinator's robust version the same as this node's?") from None


def check_of(content: RecordDict) -> tuple[str, str] | None:
    """``(author, part)`` of a spot check's task, ``None`` for a node's own work; ``ValueError``
    as :func:`read_task`."""
    check = content.config_records.get(CHECK)
    try:
        return None if check is None else (str(check["author"]), str(check["part"]))
    except KeyError as err:
        raise ValueError(f"the task lacks {err}: is the coordinator's robust version the same as this node's?") from None


def dispute_of(content: RecordDict) -> tuple[str, str, str] | None:
    """``(author, part, root)`` of a dispute's task, ``None`` for any other; ``ValueError`` as
    :func:`read_task`."""
    dispute = content.config_records.get(DISPUTE)
    try:
        return None if dispute is None else (str(dispute["author"]), str(dispute["part"]), str(dispute["root"]))
    except KeyError as err:
        raise ValueError(f"the dispute lacks {err}: is the coordinator's robust version the same as this node's?") from None


def read_task(content: RecordDict) -> tuple[Task, np.ndarray, tuple[str, str] | None]:
    """Decode a task: ``(task, model, (author, part) of a spot check or None)``; ``ValueError``
    says what is missing (a coordinator of another version)."""
    task, check = task_of(content), check_of(content)
    try:
        return task, array_of(content.array_records[MODEL]["w"]), check
    except KeyError as err:
        raise ValueError(f"the task lacks {err}: is the coordinator's robust version the same as this node's?") from None


def reply_content(reply: Reply, row: np.ndarray | Encoded | None) -> RecordDict:
    """A reply; its update a float32 ``row`` (codec ``none``) or a codec's encoding (named arrays)."""
    records: dict = {REPLY: ConfigRecord(asdict(reply))}
    if isinstance(row, dict):
        records[UPDATE] = ArrayRecord({name: npy_array(a) for name, a in row.items()})
    elif row is not None:
        records[UPDATE] = ArrayRecord({"row": npy_array(row)})
    return RecordDict(records)


def content_bytes(content: RecordDict) -> int:
    """Bytes of the arrays in a message as they travel (``.npy`` bytes, headers included; the
    config records' few hundred bytes are not counted). Never raises."""
    total = 0
    for record in content.array_records.values():
        for array in record.values():
            data = getattr(array, "data", None)
            total += len(data) if isinstance(data, (bytes, bytearray)) else 0
    return total


_TYPES = {"run": str, "round": int, "base": str, "count": int, "signature": bytes, "refused": str, "seconds": float,
          "part": str, "profile": str, "author": str, "root": str}
_OPTIONAL = {"part": "", "profile": "", "author": "", "root": ""}  # absent: empty (a node that declares none)
FIELD_CAP = 4096  # bytes: the longest text or signature a reply field may hold
HEADER_CAP = 1024  # bytes: the longest .npy header of a one-dimensional float32 array
ROW_DTYPE = np.dtype("<f4")


def read_reply(content: RecordDict, d: int, codec: Codec | None = None
               ) -> tuple[Reply, np.ndarray | None, Encoded | None]:
    """Decode a reply whose update must be ``d`` float32 values, encoded by ``codec`` (``None``
    or ``none``: the float32 row itself); ``ValueError`` says what is malformed. With codec
    ``none`` the row is read-only (it views the message's bytes) and the encoding ``None``;
    otherwise the decoded row and the checked arrays it was decoded from (read-only views:
    what the audit stores, at the codec's size)."""
    reply = _reply_of(content)
    if reply.refused:
        return reply, None, None
    if codec is not None and codec.name != "none":
        try:
            record = content.array_records[UPDATE]
        except KeyError:
            raise ValueError("no update array") from None
        return (reply, *read_encoded(record, d, codec))
    try:
        array = content.array_records[UPDATE]["row"]
    except KeyError:
        raise ValueError("no update array") from None
    return reply, read_row(array, d), None


def _reply_of(content: RecordDict) -> Reply:
    """The reply record's fields, each checked for its type and size."""
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
    return Reply(**values)


def claim_payload(reply: Reply, states_sha: str) -> bytes:
    """The bytes a node signs with its answer to a dispute: the work disputed (run, task,
    base, whose task, the root it committed to) and the SHA-256 of the states it answers with
    (one flat float32 vector, ``s_0 .. s_K`` in turn)."""
    return b"robust-dispute/v1" + json.dumps([reply.run, reply.round, reply.base, reply.author, reply.root,
                                              states_sha], ensure_ascii=True).encode()


def claim_content(reply: Reply, hashes: list[str] | None = None, states: np.ndarray | None = None) -> RecordDict:
    """A dispute's answer: the reply (signed with :func:`claim_payload`; or a refusal) with the
    state hashes ``h_0 .. h_K`` and the states as one ``(K + 1) x 2d`` float32 array, flat."""
    records: dict = {REPLY: ConfigRecord(asdict(reply))}
    if states is not None:
        records[CLAIM] = ConfigRecord({"hashes": list(hashes)})
        records[UPDATE] = ArrayRecord({"states": npy_array(states.reshape(-1))})
    return RecordDict(records)


def read_claim(content: RecordDict, d: int, steps: int, width: int = 2) -> tuple[Reply, list[str], np.ndarray | None]:
    """Decode a dispute's answer for a model of ``d`` values and ``steps`` local steps, states of
    ``width`` blocks (``Protocol.width``): ``(reply, hashes, (steps + 1, width d) float32 states)``
    (a refusal: no hashes, ``None``);
    ``ValueError`` says what is malformed: exactly ``steps + 1`` hashes of 64 hex digits, the
    states' bytes checked before they are read (``read_array``)."""
    reply = _reply_of(content)
    if reply.refused:
        return reply, [], None
    try:
        hashes, array = content.config_records[CLAIM]["hashes"], content.array_records[UPDATE]["states"]
    except KeyError as err:
        raise ValueError(f"the answer lacks {err}") from None
    if not isinstance(hashes, list) or len(hashes) != steps + 1 or not all(
            isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h) for h in hashes):
        raise ValueError(f"the answer's hashes are not {steps + 1} SHA-256 hex digests")
    size = width * d
    states = read_array(array, "states", ROW_DTYPE, (steps + 1) * size, f"{steps + 1} states of {size} float32 take")
    return reply, list(hashes), states.reshape(steps + 1, size)


def read_encoded(record: ArrayRecord, d: int, codec: Codec) -> tuple[np.ndarray, Encoded]:
    """The ``(d,)`` float32 row ``codec`` decodes from ``record``'s arrays, and those arrays:
    their names first, then each array's bytes (:func:`read_array`) against
    ``codec.layout(d)``, then the values."""
    want = codec.layout(d)
    names = list(record.keys())
    if set(names) != set(want):
        shown = ", ".join(f"{str(n)!r:.40}" for n in names[:4]) + (f", ... {len(names) - 4} more" * (len(names) > 4))
        raise ValueError(f"update has arrays [{shown}], expected {sorted(want)} (compression {codec.spec})")
    enc = {name: read_array(record[name], f"update array {name!r}", dtype, length)
           for name, (dtype, length) in want.items()}
    return codec.decode(enc, d).numpy(), enc


def read_row(array: Array, d: int) -> np.ndarray:
    """The ``(d,)`` float32 values in ``array``'s bytes, checked before they are decoded."""
    return read_array(array, "update", ROW_DTYPE, d, f"a model of {d} float32 values takes")


def read_array(array: Array, what: str, dtype: np.dtype, length: int, budget: str = "") -> np.ndarray:
    """The ``(length,)`` values of ``dtype`` in ``array``'s bytes, checked before they are read:
    byte count against the cap, then the ``.npy`` header's dtype and shape, then the labels.
    Read-only (it views the message's bytes). ``what`` names the array in the reasons."""
    data, size = array.data, length * dtype.itemsize
    budget = budget or f"({length},) {dtype.name} takes"
    if array.stype != "numpy.ndarray" or not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"{what} serialised as {str(array.stype)[:40]!r}, expected numpy.ndarray")
    if len(data) > size + HEADER_CAP:
        raise ValueError(f"{what} is {len(data)} bytes, {budget} at most {size + HEADER_CAP}")
    try:
        shape, _, header_dtype, offset = npy_header(data)
    except ValueError as err:
        raise ValueError(f"{what} bytes are not a .npy array ({err})") from None
    if header_dtype != dtype:
        raise ValueError(f"{what} bytes hold {header_dtype}, labelled {str(array.dtype)[:40]}: expected {dtype.name}")
    if tuple(shape) != (length,):
        raise ValueError(f"{what} bytes hold shape {tuple(shape)}, expected ({length},)")
    try:
        labels = (str(array.dtype), tuple(int(n) for n in array.shape))
    except (TypeError, ValueError):
        labels = None
    if labels != (dtype.name, (length,)):
        raise ValueError(f"{what} labelled {str(labels)[:80]}, its bytes are {dtype.name} ({length},)")
    if len(data) - offset != size:
        raise ValueError(f"{what} holds {len(data) - offset} value bytes, ({length},) {dtype.name} takes {size}")
    view = np.frombuffer(data, dtype=dtype, count=length, offset=offset)
    view.flags.writeable = False
    return view


def npy_header(data: bytes | bytearray) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, Fortran order, dtype, where the values start)`` of the ``.npy`` bytes ``data``
    (a header of at most ``HEADER_CAP`` bytes); ``ValueError`` naming the parser's failure."""
    head = io.BytesIO(bytes(memoryview(data)[:HEADER_CAP + 12]))  # the magic, the header's length, the header
    try:
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(head)]
        shape, fortran, dtype = read_header(head, max_header_size=HEADER_CAP)
    except Exception as err:  # noqa: BLE001 - untrusted bytes: any parser failure is a rejection
        raise ValueError(type(err).__name__) from None
    return tuple(shape), fortran, dtype, head.tell()


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


def _arrays(content: RecordDict) -> list[tuple[str, str]]:
    """``(record, array)`` names of every array in ``content``, in one order both sides agree on."""
    return [(name, key) for name in sorted(content.array_records) for key in sorted(content.array_records[name])]


def pack(content: RecordDict, take: bool = False) -> list[bytes]:
    """A message's content as frames for the volunteer's local channel (``nodes.volunteer.channel``):
    Flower's protobuf form of ``content`` with every array's bytes left out, then those bytes,
    one frame per array (the arrays' own bytes objects: a 400 MB model is not copied). ``take``:
    the frames become the only holders of those bytes (each array of ``content`` left empty), so
    they are let go once sent."""
    records = {name: ArrayRecord({key: Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=b"")
                                  for key, a in record.items()}) if isinstance(record, ArrayRecord) else record
               for name, record in content.items()}
    frames = [recorddict_to_proto(RecordDict(records)).SerializeToString()]
    for name, key in _arrays(content):
        array = content.array_records[name][key]
        frames.append(array.data)
        if take:
            array.data = b""
    return frames


def array_of(array: Array) -> np.ndarray:
    """The ndarray ``array`` holds: a view of its bytes where they are a ``bytearray`` (what
    :func:`unpack` leaves: the model is not copied), else Flower's own copy (``Array.numpy``).
    ``ValueError`` if the bytes are not one ``.npy`` array."""
    data = array.data
    if not isinstance(data, bytearray):
        return array.numpy()
    try:
        shape, fortran, dtype, offset = npy_header(data)
    except ValueError as err:
        raise ValueError(f"not a .npy array ({err})") from None
    count = math.prod(shape)
    if dtype.hasobject or offset + count * dtype.itemsize != len(data):
        raise ValueError(f"not a .npy array ({len(data)} bytes for {count} of {dtype} after a {offset}-byte header)")
    return np.frombuffer(data, dtype, count, offset).reshape(shape, order="F" if fortran else "C")


def unpack(frames: list[bytes | bytearray]) -> RecordDict:
    """The content :func:`pack` made ``frames`` of; ``ValueError`` if they are none. Consumes
    ``frames``: each array keeps its frame as its bytes (a ``bytearray`` as the channel reads it:
    no copy; :func:`array_of` views it, and Flower sends it as it is, slicing an array's bytes
    through a ``memoryview``)."""
    try:
        content = recorddict_from_proto(ProtoRecordDict.FromString(frames[0]))
    except Exception as err:  # noqa: BLE001 - any parser failure means: not a message's content
        raise ValueError(f"not a message's content ({type(err).__name__})") from None
    names = _arrays(content)
    if len(frames) != len(names) + 1:
        raise ValueError(f"not a message's content ({len(names)} arrays, {len(frames) - 1} frames of bytes)")
    del frames[0]
    for name, key in names:
        array = content.array_records[name][key]
        if array.data:
            raise ValueError(f"not a message's content (array {name}.{key} holds bytes in its skeleton)")
        data = frames.pop(0)
        array.data = data
        del data
    return content
