"""Fuzzing the reply path: arbitrary Flower ``RecordDict`` replies thrown at
:meth:`Coordinator.take` and :meth:`Coordinator.finish_round`.

Whatever a node sends, nothing may escape ``take`` or ``finish_round``; each node is filed in
exactly one of ``rows`` / ``rejected`` / ``failed`` (``rows`` only for a reply that is genuinely
valid: well-formed, for this run, round and base model, a finite row within the norm bound,
signed by that node's own key, a sample count in range); an accepted row is bit for bit the row
that was signed; the model stays a finite float32 vector of its shape; the round's line in
``rounds.jsonl`` is strict JSON; and a coordinator restarted from the folder resumes.

The replies mix: missing records, records of the wrong kind, every reply field missing, of the
wrong type (bools for ints, numpy scalars), over the size cap, ``seconds`` non-finite or
negative; declined replies; update arrays with lying dtype / shape / stype labels and random
bytes, valid ``.npy`` bytes of other dtypes and shapes, hand-made ``.npy`` headers, truncated or
padded bytes; correctly signed replies with NaN / inf / huge / bound-straddling rows or counts
out of range; honest replies (``federation_kit.replies``) mutated in one field. Each reply
either goes as built or, when Flower can serialise it, through a protobuf round trip (what the
ServerApp actually receives).
"""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from nodes import checkpoint
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.inbox import Inbox
from nodes.settings import Settings
from nodes.wire import REPLY, UPDATE, read_reply, signed_payload
from robust import keys
from robust.params import sha256

from .federation_kit import fingerprint, make_federation, replies, take

SETTINGS = Settings(rounds=1000, model="logreg", aggregator="trimmed-mean", tolerate=1, quorum=3,
                    protocol="delta:steps=2")
NODES = 5  # admitted volunteers (real keys); nodes 1-4 are the honest ones of the mixed round
STRANGERS = ["f" * 64, "0123456789ab" * 5 + "cdef"]  # fingerprints that are not admitted
TYPES = {"run": str, "round": int, "base": str, "count": int, "signature": bytes, "refused": str, "seconds": float}
CAP = 4096  # nodes.wire.FIELD_CAP, restated: the spec under test
MISSING = object()
pytestmark = pytest.mark.filterwarnings("ignore:Field flwr.proto.Array.shape:DeprecationWarning")
FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


# --- the federation: built once, copied for each test --------------------------------------

@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-federation")
    coord_dir, nodes = make_federation(root, NODES, SETTINGS)
    return root, coord_dir, nodes


@pytest.fixture
def federation(template, tmp_path, monkeypatch):
    """A copy of the template federation. Every round fsyncs its checkpoint and log: what is
    tested here is not durability, and on a busy disk the fsyncs would take most of the time."""
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: None)
    root, coord_dir, nodes = template
    copy = tmp_path / "federation"
    shutil.copytree(root, copy)
    return copy / coord_dir.relative_to(root), [copy / n.relative_to(root) for n in nodes]


# --- what the coordinator is asked this round -----------------------------------------------

@dataclass(repr=False)
class Ctx:
    coord: Coordinator
    nodes: list[Path]
    fps: list[str]  # admitted fingerprints, in node order
    keys: list
    _honest: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Ctx(round={self.round})"

    @property
    def d(self) -> int:
        return self.coord.engine.w.numel()

    @property
    def run(self) -> str:
        return self.coord.run_id

    @property
    def round(self) -> int:
        return self.coord.round + 1

    @property
    def base(self) -> str:
        return self.coord.engine.base

    @property
    def cap(self) -> int:
        return self.d * 4 + 1024

    def honest(self, i: int) -> tuple[dict, np.ndarray]:
        """Node ``i``'s honest reply to this round's task (from ``replies``): its fields and row."""
        key = (self.round, self.base, i)
        if key not in self._honest:
            self._honest = {k: v for k, v in self._honest.items() if k[:2] == key[:2]}  # this round's only
            (fp, content), = replies(self.coord, [self.nodes[i]])
            assert fp == self.fps[i]
            reply, row, _ = read_reply(content, self.d)
            self._honest[key] = (dict(content.config_records[REPLY]), np.array(row, dtype=np.float32))
        cfg, row = self._honest[key]
        return dict(cfg), row.copy()


@dataclass
class Info:
    """What the test knows of a reply it built from a signature: what was signed, by whom."""

    signer: str
    signed: dict  # run, round, base, count, signature as signed
    row: np.ndarray
    array: str  # "intact" (the signed row, canonical bytes), "changed", "unsure"


def field_verdict(rec) -> str | None:
    """The spec of a reply record's fields: "rejected" if malformed, "failed" if declined."""
    for name, kind in TYPES.items():
        value = rec.get(name, MISSING)
        if type(value) is not kind:
            return "rejected"
        if isinstance(value, (str, bytes)) and len(value) > CAP:
            return "rejected"
    if not (math.isfinite(rec["seconds"]) and rec["seconds"] >= 0):
        return "rejected"
    return "failed" if rec["refused"] else None


def expected(ctx: Ctx, fp: str, content: RecordDict, info: Info | None) -> str:
    """Where the coordinator must file ``content`` from ``fp``: rows / rejected / failed / any."""
    rec = content.config_records.get(REPLY)
    if rec is None:
        return "rejected"
    verdict = field_verdict(rec)
    if verdict:
        return verdict
    if info is None:  # random signature bytes: no valid reply
        return "rejected"
    if any(rec[k] != v for k, v in info.signed.items()):
        return "rejected"
    if (rec["run"], rec["round"], rec["base"]) != (ctx.run, ctx.round, ctx.base):
        return "rejected"
    if info.signer != fp or not 1 <= rec["count"] <= SETTINGS.max_count:
        return "rejected"
    if not np.isfinite(info.row).all():
        return "rejected"
    norm = float(np.linalg.norm(info.row.astype(np.float64)))
    if abs(norm - SETTINGS.max_norm) <= 1e-9 * SETTINGS.max_norm:
        return "any"  # on the bound to rounding: either verdict is right
    if norm > SETTINGS.max_norm:
        return "rejected"
    update = content.array_records.get(UPDATE)
    if update is None or "row" not in update:
        return "rejected"
    return {"intact": "rows", "changed": "rejected", "unsure": "any"}[info.array]


# --- strategies -----------------------------------------------------------------------------

def npy(array: np.ndarray, version=None) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, version=version, allow_pickle=False)
    return out.getvalue()


def raw_npy(descr: str, fortran: str, shape: str, version: int, payload: bytes, lie: int) -> bytes:
    """A hand-made ``.npy`` header (any text in its fields) and payload; ``lie`` skews the
    header length the preamble states."""
    header = "{'descr': %s, 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape)
    header = header.encode("utf-8", "surrogatepass")
    size = 6 + 2 + (2 if version == 1 else 4)
    header += b" " * ((-(size + len(header) + 1)) % 64) + b"\n"
    length = max(0, len(header) + lie)
    if version == 1:
        pre = b"\x93NUMPY\x01\x00" + struct.pack("<H", min(length, 0xFFFF))
    else:
        pre = b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", length)
    return pre + header + payload


SECONDS = [float("inf"), float("nan"), -1.0, float("-inf"), -5e-324, -0.0, 0.0, 1e308, 5e-324]
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4028235e38, -3.4028235e38]


@st.composite
def values(draw, d: int, dtype: str, shape: tuple) -> np.ndarray:
    """An array of ``dtype`` and ``shape``: seeded random values, a scale, a few special values."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 1e3, 1e30]))
    with np.errstate(all="ignore"):
        base = np.asarray(rng.standard_normal(shape), dtype=np.float64) * scale
        kind = np.dtype(dtype).kind
        if kind == "b":
            return np.array(base > 0)
        if kind in "iu":
            info = np.iinfo(dtype)
            return np.array(np.clip(base, info.min, info.max), dtype=dtype)
        array = np.array(base, dtype=dtype)
        flat = array.reshape(-1)
        if flat.size and kind in "fc":
            for _ in range(draw(st.integers(0, 3))):
                flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from(SPECIALS))
        return array


def shapes(d: int):
    return st.sampled_from([(d,), (), (0,), (d - 1,), (d + 1,), (1, d), (d, 1), (2, d // 2), (d, 2), (4 * d,)])


DTYPES = ["<f4", "<f8", "<f2", "<i4", ">f4", ">f8", "|i1", "|u1", "|b1", "<c8", "<i8"]


@st.composite
def payloads(draw, ctx: Ctx) -> bytes:
    """The bytes of an update: .npy of any dtype / shape / header version, hand-made headers,
    truncated, padded or flipped, or random bytes of any size around the cap."""
    d = ctx.d
    kind = draw(st.sampled_from(["npy", "npy", "npy-f4", "raw", "random", "big", "edited", "empty"]))
    if kind in ("npy", "npy-f4"):
        dtype = "<f4" if kind == "npy-f4" else draw(st.sampled_from(DTYPES))
        shape = (d,) if kind == "npy-f4" else draw(shapes(d))
        version = draw(st.sampled_from([None, (1, 0), (2, 0), (3, 0)]))
        return npy(draw(values(d, dtype, shape)), version)
    if kind == "raw":
        descr = draw(st.sampled_from(["'<f4'", "'>f4'", "'=f4'", "'|f4'", "'<f8'", "'O'", "'|b1'", "'<U4'",
                                      "[('a', '<f4')]", "('<f4', (1,))", "'float32'", "'<f4 '", "42", "None"])
                     | st.text(max_size=30).map(repr) | st.text(max_size=30))
        fortran = draw(st.sampled_from(["False", "True", "0", "None", "'no'"]))
        shape = draw(st.sampled_from([f"({d},)", f"({d - 1},)", "()", f"(1, {d})", f"({d}.0,)", "(-1,)",
                                      f"({2**62},)", f"({2**64},)", "None", f"[{d}]", f"({d}, 0)"])
                     | st.text(max_size=20))
        version = draw(st.sampled_from([1, 2, 3, 4, 0]))
        n = draw(st.sampled_from([4 * d, 4 * d - 1, 4 * d + 1, 0, 8 * d, 4 * (d - 1)]))
        payload = np.random.default_rng(draw(st.integers(0, 2**16))).bytes(n)
        lie = draw(st.sampled_from([0, 0, 0, -1, 1, -64, 64, 10**6]))
        return raw_npy(descr, fortran, shape, version, payload, lie)
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "big":
        cap = ctx.cap
        n = draw(st.sampled_from([cap - 1, cap, cap + 1, 4 * d, 4 * d + 128, 10 * cap]))
        data = np.random.default_rng(draw(st.integers(0, 2**16))).bytes(n)
        if draw(st.booleans()):
            data = b"\x93NUMPY\x01\x00" + data[8:]
        return data
    if kind == "edited":  # a valid (d,) float32 file, then cut, padded or one byte flipped
        data = bytearray(npy(draw(values(d, "<f4", (d,)))))
        edit = draw(st.sampled_from(["cut", "pad", "flip"]))
        at = draw(st.integers(0, len(data) - 1))
        if edit == "cut":
            return bytes(data[:at])
        if edit == "pad":
            return bytes(data) + draw(st.binary(min_size=1, max_size=8))
        data[at] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    return b""


@st.composite
def arrays(draw, ctx: Ctx) -> Array:
    """An update ``Array``: truthful (``Array(ndarray)``), labelled with lies, or (rarely)
    tampered with after it was built (what no wire could carry)."""
    d = ctx.d
    kind = draw(st.sampled_from(["truthful", "truthful", "labelled", "labelled", "labelled", "tampered"]))
    if kind == "truthful":
        dtype = draw(st.sampled_from(["<f4", "<f4", *DTYPES]))
        shape = draw(st.sampled_from([(d,), (d,)]) | shapes(d))
        return Array(draw(values(d, dtype, shape)))
    dtype = draw(st.sampled_from(["float32", "float64", "<f4", ">f4", "float16", "int32", "", "object", "bool"])
                 | st.text(max_size=20))
    shape = draw(shapes(d) | st.lists(st.integers(-2**63, 2**63 - 1), max_size=4).map(tuple)
                 | st.sampled_from([(-d,), (2**31 - 1,), (True,) * 1]))
    stype = draw(st.sampled_from(["numpy.ndarray"] * 3 + ["torch", ""]) | st.text(max_size=20))
    array = Array(dtype=dtype, shape=shape, stype=stype, data=draw(payloads(ctx)))
    if kind == "tampered":
        name, value = draw(st.sampled_from([
            ("shape", None), ("shape", str(d)), ("shape", [d]), ("shape", (float(d),)), ("shape", (np.int64(d),)),
            ("shape", (d, None)), ("dtype", None), ("dtype", 32), ("data", None), ("data", "text"),
            ("data", bytearray(8)), ("stype", None),
        ]))
        object.__setattr__(array, name, value)
    return array


def junk():
    """Any value a ConfigRecord takes (and numpy scalars that subclass its types)."""
    big = st.integers(CAP - 1, CAP + 600)
    return st.one_of(
        st.integers(-2**70, 2**70), st.booleans(), st.floats(), st.text(max_size=40), st.binary(max_size=40),
        st.builds(lambda c, n: c * n, st.characters(), big), st.builds(lambda n: b"\x00" * n, big),
        st.lists(st.integers(-5, 5), max_size=3), st.lists(st.text(max_size=3), max_size=3), st.just([]),
        st.lists(st.floats(), min_size=1, max_size=3),
        st.sampled_from([np.float64(1.0), np.float64("nan"), np.str_("x"), np.bytes_(b"x")]),
    )


def plausible(name: str, ctx: Ctx):
    """Values of the field's own type, right or wrong for this round."""
    return {
        "run": st.sampled_from([ctx.run, ctx.run, "", ctx.run + " "]) | st.text(max_size=20),
        "round": st.sampled_from([ctx.round, ctx.round, ctx.round - 1, ctx.round + 1, 0, -1, 2**63 - 1]),
        "base": st.sampled_from([ctx.base, ctx.base, "0" * 64, ctx.base.upper(), ""]),
        "count": st.sampled_from([1, 100, SETTINGS.max_count, 0, -1, SETTINGS.max_count + 1, 10**12]),
        "signature": st.binary(max_size=120),
        "refused": st.sampled_from(["", "", "", "busy"]) | st.text(max_size=30),
        "seconds": st.floats() | st.sampled_from(SECONDS),
    }[name]


def mutated(name: str, ctx: Ctx):
    """A replacement for one field: gone, of any type or its own."""
    return st.one_of(st.just(MISSING), junk(), plausible(name, ctx))


def put(cfg: dict, name: str, value) -> dict:
    cfg = dict(cfg)
    if value is MISSING:
        cfg.pop(name, None)
    else:
        cfg[name] = value
    return cfg


@st.composite
def reply_records(draw, ctx: Ctx):
    """The record under "reply": well-typed fields (so that the update is read), fuzzed
    fields, a record of the wrong kind, or none."""
    kind = draw(st.sampled_from(["typed"] * 4 + ["fuzzed"] * 3 + ["metric", "array", "none"]))
    if kind == "none":
        return None
    if kind == "metric":
        return MetricRecord({"round": ctx.round, "count": 1, "seconds": 0.0})
    if kind == "array":
        return arrays_record({"run": Array(np.zeros(3, np.float32))})
    cfg = {}
    for name in TYPES:
        if kind == "typed":
            if name == "seconds":
                value = draw(plausible(name, ctx) if draw(st.integers(0, 3)) == 0 else st.floats(0, 1e6))
            else:
                value = draw(st.just("") if name == "refused" else plausible(name, ctx))
        elif draw(st.integers(0, 3)):
            value = draw(plausible(name, ctx))
        else:
            value = draw(mutated(name, ctx))
        cfg = put(cfg, name, value)
    for extra in draw(st.lists(st.sampled_from(["Round", "reply", "update", "x" * 100, ""]), max_size=2)):
        cfg[extra] = draw(junk())
    return ConfigRecord(cfg)


@st.composite
def update_records(draw, ctx: Ctx):
    kind = draw(st.sampled_from(["row"] * 6 + ["none", "empty", "renamed", "extra", "config", "metric"]))
    if kind == "none":
        return None
    if kind == "empty":
        return ArrayRecord()
    if kind == "config":
        return ConfigRecord({"row": draw(st.binary(max_size=64))})
    if kind == "metric":
        return MetricRecord({"row": [0.0] * 4})
    array = draw(arrays(ctx))
    if kind == "renamed":
        return arrays_record({"Row": array})
    if kind == "extra":
        return arrays_record({"row": array, "more": draw(arrays(ctx))})
    return arrays_record({"row": array})


def arrays_record(arrays: dict) -> ArrayRecord:
    """An ``ArrayRecord`` holding these very ``Array`` objects (its constructor would rebuild
    them, and refuse a tampered one)."""
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


def content_of(reply, update, extras=()) -> RecordDict:
    records = {}
    if reply is not None:
        records[REPLY] = reply
    if update is not None:
        records[UPDATE] = update
    for name, record in extras:
        records.setdefault(name, record)
    return RecordDict(records)


EXTRAS = st.lists(st.tuples(st.sampled_from(["Reply", "reply ", "model", "task", "x" * 300]),
                            st.sampled_from([ConfigRecord, MetricRecord, ArrayRecord]).map(
                                lambda kind: kind() if kind is ArrayRecord else kind({"a": 1}))),
                  max_size=2)


@st.composite
def random_reply(draw, ctx: Ctx):
    """A reply made of fuzz alone (its signature is random bytes)."""
    return content_of(draw(reply_records(ctx)), draw(update_records(ctx)), draw(EXTRAS)), None, "random"


@st.composite
def encodings(draw, row: np.ndarray):
    """The signed row's values sent another way: ``(Array, status, how)``. Labels that lie
    about valid bytes, trailing bytes, another dtype are "changed" (the wire spec rejects
    them); another .npy version of the same values is "unsure" (either verdict is right)."""
    d = row.size
    how = draw(st.sampled_from(["canonical", "dtype label", "shape label", "stype", "padded", "version",
                                ">f4", "float64", "2-d"]))
    data = npy(row)
    if how == "canonical":
        return Array(row.copy()), "intact", how
    if how == "dtype label":
        label = draw(st.sampled_from(["float64", "<f4", "float16", "int32", "", "float32 "]) | st.text(max_size=10))
        return Array(dtype=label, shape=(d,), stype="numpy.ndarray", data=data), \
            ("intact" if label == "float32" else "changed"), how
    if how == "shape label":
        shape = draw(shapes(d) | st.lists(st.integers(-2**40, 2**40), max_size=3).map(tuple))
        return Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=data), \
            ("intact" if shape == (d,) else "changed"), how
    if how == "stype":
        stype = draw(st.sampled_from(["", "torch", "numpy.ndarray "]) | st.text(max_size=10))
        return Array(dtype="float32", shape=(d,), stype=stype, data=data), \
            ("intact" if stype == "numpy.ndarray" else "changed"), how
    if how == "padded":
        extra = draw(st.binary(min_size=1, max_size=16))
        return Array(dtype="float32", shape=(d,), stype="numpy.ndarray", data=data + extra), "changed", how
    if how == "version":
        data = npy(row, draw(st.sampled_from([(2, 0), (3, 0)])))
        return Array(dtype="float32", shape=(d,), stype="numpy.ndarray", data=data), "unsure", how
    if how == "2-d":
        return Array(row.reshape(1, d)), "changed", how
    sent = row.astype(how)
    truthful = draw(st.booleans())  # its own labels, or float32's
    return (Array(sent) if truthful else Array(dtype="float32", shape=(d,), stype="numpy.ndarray", data=npy(sent))), \
        "changed", how


@st.composite
def signed_reply(draw, ctx: Ctx, fp: str):
    """A reply signed with an admitted key (mostly ``fp``'s own), its row drawn to probe the
    row checks: any scale, NaN / inf / subnormal values, a norm just around the bound."""
    d = ctx.d
    signer = draw(st.sampled_from([fp if fp in ctx.fps else ctx.fps[0]] * 8 + ctx.fps))
    row = draw(values(d, "<f4", (d,)))
    if draw(st.booleans()):  # exactly around the norm bound
        with np.errstate(all="ignore"):
            row = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(d)
            ratio = draw(st.sampled_from([1 - 1e-3, 1 - 1e-6, 1.0, 1 + 1e-6, 1 + 1e-3, 0.5, 2.0]))
            row = (row / np.linalg.norm(row) * SETTINGS.max_norm * ratio).astype(np.float32)
    fields = {"run": ctx.run, "round": ctx.round, "base": ctx.base, "count": draw(st.integers(1, 10**4))}
    cfg = {"refused": "", "seconds": draw(st.floats(0, 1e4))}
    wrong = draw(st.sampled_from([None] * 4 + ["run", "round", "base", "count", "refused", "seconds", "type"]))
    if wrong == "type":
        fields["round"] = draw(st.sampled_from([True, False, float(ctx.round)]))
    elif wrong in fields:
        fields[wrong] = draw(plausible(wrong, ctx))
    elif wrong == "seconds":
        cfg[wrong] = draw(st.sampled_from(SECONDS))
    elif wrong:
        cfg[wrong] = draw(plausible(wrong, ctx))
    payload = signed_payload(str(fields["run"]), fields["round"], str(fields["base"]),
                             sha256(torch.from_numpy(row)), fields["count"])
    signature = keys.sign(ctx.keys[ctx.fps.index(signer)], payload)
    cfg = {**fields, "signature": signature, **cfg}
    array, status, how = draw(encodings(row)) if draw(st.integers(0, 2)) == 0 else (Array(row), "intact", "")
    content = content_of(ConfigRecord(cfg), arrays_record({"row": array}), draw(EXTRAS))
    info = Info(signer, {**fields, "signature": signature}, row, status)
    return content, info, f"signed by {signer[:8]}, {how or 'canonical'}, wrong {wrong}"


@st.composite
def honest_reply(draw, ctx: Ctx, fp: str, own: bool = True):
    """Node i's honest reply (``federation_kit.replies``), sent as ``fp`` (mostly i's own, or
    only another node's if not ``own``), mutated in one place (or not at all)."""
    if own and fp in ctx.fps:
        i = draw(st.sampled_from([ctx.fps.index(fp)] * 12 + list(range(NODES))))
    else:
        i = draw(st.sampled_from([j for j in range(NODES) if ctx.fps[j] != fp]))
    cfg, row = ctx.honest(i)
    signed = {k: cfg[k] for k in ("run", "round", "base", "count", "signature")}
    info = Info(ctx.fps[i], signed, row, "intact")
    reply, update, extras = ConfigRecord(cfg), arrays_record({"row": Array(row)}), []
    how = draw(st.sampled_from(["none", "field", "field", "field", "array", "array", "record", "extras"]))
    what = how
    if how == "field":
        name = draw(st.sampled_from(list(TYPES)))
        value = draw(mutated(name, ctx))
        reply, what = ConfigRecord(put(cfg, name, value)), f"field {name}={str(value)[:40]!r}"
    elif how == "array":
        change = draw(st.sampled_from(["fuzz", "fuzz", "encoded", "encoded", "bump", "nan"]))
        if change == "fuzz":
            update, info.array = arrays_record({"row": draw(arrays(ctx))}), "unsure"
        elif change == "encoded":
            array, info.array, change = draw(encodings(row))
            update = arrays_record({"row": array})
        else:
            other = row.copy()
            at = draw(st.integers(0, ctx.d - 1))
            other[at] = np.nextafter(other[at], np.float32(np.inf)) if change == "bump" else np.nan
            update, info.array = arrays_record({"row": Array(other)}), "changed"
        what = f"array {change}"
    elif how == "record":
        change = draw(st.sampled_from(["no reply", "no update", "reply metric", "update config", "update renamed"]))
        what = change
        if change == "no reply":
            reply = None
        elif change == "no update":
            update = None
        elif change == "reply metric":
            reply = MetricRecord({"round": ctx.round, "count": int(cfg["count"]), "seconds": 0.0})
        elif change == "update config":
            update = ConfigRecord({"row": npy(row)})
        else:
            update = arrays_record({"rows": Array(row)})
    elif how == "extras":
        extras = draw(EXTRAS)
    return content_of(reply, update, extras), info, f"honest {i + 1}, {what}"


def wire(content: RecordDict) -> RecordDict:
    """``content`` after a protobuf round trip, or as is if Flower cannot serialise it."""
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

    try:
        return recorddict_from_proto(recorddict_to_proto(content))
    except Exception:  # noqa: BLE001 - the sender could not have sent it: keep the in-memory one
        return content


@st.composite
def fuzzed(draw, ctx: Ctx, fps: list[str], kinds=("random", "signed", "honest"), own: bool = True):
    """``(fp, content, info, what)``: a reply from one of ``fps``, of one of ``kinds``."""
    fp = draw(st.sampled_from(fps))
    kind = draw(st.sampled_from(kinds))
    if kind == "random":
        content, info, what = draw(random_reply(ctx))
    elif kind == "signed":
        content, info, what = draw(signed_reply(ctx, fp))
    else:
        content, info, what = draw(honest_reply(ctx, fp, own))
    if draw(st.booleans()):
        content, what = wire(content), what + " (wire)"
    return fp, content, info, what


# --- the checks -----------------------------------------------------------------------------

def strict_json(line: str) -> dict:
    def refuse(token):
        raise AssertionError(f"non-finite number {token} in rounds.jsonl")

    return json.loads(line, parse_constant=refuse)


def check_round(coord: Coordinator, folder: Path, record: dict, inbox: Inbox, d: int) -> None:
    w = coord.engine.w
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32 and tuple(w.shape) == (d,)
    assert bool(torch.isfinite(w).all())
    assert coord.engine.base == sha256(w)
    line = (folder / checkpoint.ROUNDS).read_text().splitlines()[-1]
    logged = strict_json(line)
    assert "NaN" not in line and "Infinity" not in line
    assert logged["round"] == record["round"] == coord.round
    assert logged["model_sha256"] == coord.engine.base
    assert json.dumps(checkpoint.finite(record), allow_nan=False)
    assert record["ids"] == sorted(inbox.rows), "the engine re-rejected a row take accepted"
    assert set(record["rejected"]) == set(inbox.rejected) and set(record["failed"]) == set(inbox.failed)


def check_filed(inbox: Inbox, fp: str, verdict: str, info: Info | None, what: str) -> None:
    where = [name for name in ("rows", "rejected", "failed") if fp in getattr(inbox, name)]
    assert len(where) == 1, (fp[:8], what, where)
    if verdict != "any":
        assert where == [verdict], (fp[:8], what, verdict, where, inbox.rejected.get(fp), inbox.failed.get(fp))
    if where == ["rows"]:
        row = inbox.rows[fp]
        assert info is not None and row.dtype == torch.float32 and tuple(row.shape) == (info.row.size,)
        assert np.array_equal(row.numpy().view(np.uint32), info.row.view(np.uint32)), "accepted a row nobody signed"
    if where == ["rejected"]:
        reason = inbox.rejected[fp]
        assert reason and not reason.startswith(("reply could not be read", "reply could not be checked")), (
            f"an unexpected exception was caught for {what}: {reason}")


def context(coord_dir: Path, nodes: list[Path]) -> Ctx:
    return Ctx(Coordinator(coord_dir), nodes, [fingerprint(n) for n in nodes],
               [keys.load_private(n) for n in nodes])


def check_resumes(ctx: Ctx, coord_dir: Path) -> None:
    again = Coordinator(coord_dir)
    assert again.round == ctx.coord.round and again.engine.base == ctx.coord.engine.base
    assert torch.equal(again.engine.w, ctx.coord.engine.w)


# --- the tests ------------------------------------------------------------------------------

def test_fuzzed_replies_are_filed_once_and_never_break_the_round(federation):
    """Up to 6 fuzzed replies a round (admitted and unknown nodes, a node possibly answering
    twice); each is filed where the spec says; the round completes; the model stays sane."""
    coord_dir, nodes = federation
    ctx = context(coord_dir, nodes)
    d = ctx.d
    everyone = ctx.fps + STRANGERS

    @FUZZ
    @given(st.data())
    def round_of_fuzz(data):
        entries = data.draw(st.lists(fuzzed(ctx, everyone), min_size=1, max_size=6), label="replies")
        inbox, verdicts = Inbox(), {}
        for fp, content, info, what in entries:
            note(f"{fp[:8]}: {what}")
            take(ctx.coord, fp, content, inbox)
            if ctx.coord.ledger.barred(fp):
                assert fp not in inbox  # a quarantined node's reply is not read
            elif fp not in verdicts:  # a node answers once a round: the second reply is ignored
                verdicts[fp] = (expected(ctx, fp, content, info), info, what)
        assert len(inbox.rows) + len(inbox.rejected) + len(inbox.failed) == len(verdicts)
        for fp, (verdict, info, what) in verdicts.items():
            check_filed(inbox, fp, verdict, info, what)
        w, round = ctx.coord.engine.w.clone(), ctx.coord.round
        asked = sorted(set(verdicts) | set(data.draw(st.sets(st.sampled_from(everyone)), label="asked, silent")))
        record = ctx.coord.finish_round(asked, inbox, time.monotonic())
        assert ctx.coord.round == round + 1
        check_round(ctx.coord, coord_dir, record, inbox, d)
        assert record["missing"] == sorted(set(asked) - set(verdicts))
        if record["skipped"]:
            assert torch.equal(ctx.coord.engine.w, w)

    round_of_fuzz()
    check_resumes(ctx, coord_dir)


def test_honest_replies_still_step_amid_fuzzed_ones(federation):
    """0-4 honest nodes reply (``federation_kit.replies``) among fuzzed replies from the other
    nodes, in any order: exactly the honest rows are accepted, and the model moves iff they
    make the quorum."""
    coord_dir, nodes = federation
    ctx = context(coord_dir, nodes)
    d = ctx.d

    @settings(FUZZ, max_examples=80)
    @given(st.data())
    def mixed_round(data):
        honest = data.draw(st.sampled_from([4, 4, 3, 3, 2, 0]).flatmap(
            lambda k: st.permutations(range(4)).map(lambda p: sorted(p[:k]))), label="honest nodes")
        others = [fp for i, fp in enumerate(ctx.fps) if i not in honest] + STRANGERS
        got = replies(ctx.coord, [nodes[i] for i in honest])
        fuzz = data.draw(st.lists(fuzzed(ctx, others, kinds=("random", "random", "honest"), own=False),
                                  min_size=1, max_size=5), label="fuzzed replies")
        arrivals = [(fp, content, None, "honest reply") for fp, content in got] + fuzz
        order = data.draw(st.permutations(range(len(arrivals))), label="arrival order")
        inbox, verdicts = Inbox(), {}
        for k in order:
            fp, content, info, what = arrivals[k]
            note(f"{fp[:8]}: {what}")
            take(ctx.coord, fp, content, inbox)
            if ctx.coord.ledger.barred(fp):
                assert fp not in inbox  # a quarantined node's reply is not read
            elif k >= len(got):  # a fuzzed one
                verdicts.setdefault(fp, (expected(ctx, fp, content, info), info, what))
        valid_fuzz = {fp for fp, (v, _, _) in verdicts.items() if v == "rows"}
        assert valid_fuzz == set(), "an honest reply sent as another node would be valid"
        honest = [i for i in honest if not ctx.coord.ledger.barred(ctx.fps[i])]  # a quarantined node is not read
        assert sorted(inbox.rows) == sorted(ctx.fps[i] for i in honest)
        for fp, (verdict, info, what) in verdicts.items():
            check_filed(inbox, fp, verdict, info, what)
        base = ctx.coord.engine.base
        asked = sorted({ctx.fps[i] for i in honest} | {fp for fp, *_ in fuzz})
        record = ctx.coord.finish_round(asked, inbox, time.monotonic())
        check_round(ctx.coord, coord_dir, record, inbox, d)
        assert record["accepted"] == len(honest)
        if len(honest) >= SETTINGS.quorum:
            assert not record["skipped"] and ctx.coord.engine.base != base, "the model did not move"
        else:
            assert record["skipped"] and ctx.coord.engine.base == base

    mixed_round()
    check_resumes(ctx, coord_dir)
