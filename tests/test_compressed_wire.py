"""Compressed updates on the wire (issue 11): volunteers encode with the run's codec, the
coordinator checks each encoded array before it decodes, and everything after (signatures,
validation, the engine, spot checks, the audit) works on the decoded rows. In-process
(``federation_kit``), the loopback deployment with int8 is tests/test_federation_deploy.py's resume test."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

from nodes import checkpoint
from nodes.coordinator import audit
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.inbox import Inbox
from nodes.coordinator.verifier import Checkers
from nodes.engine.training import NodeData, compute
from nodes.settings import Settings
from nodes.volunteer.client_app import content as wire_content
from nodes.volunteer.volunteer import check, load_residual, prepare_data, work
from nodes.wire import UPDATE, read_reply, read_task, reply_content, reply_payload, task_content
from robust import codecs, keys
from robust.params import sha256

from .federation_kit import fingerprint, make_federation, play, replies, take

CODECS = ["none", "fp16", "int8", "topk:k=0.01", "randk:k=0.01", "sign", "shared-sign"]
BASE = dict(rounds=2, aggregator="trimmed-mean", tolerate=1, quorum=3, protocol="delta:steps=2", batch_size=16)
CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:Field flwr.proto.Array.shape:DeprecationWarning")


def _federation(tmp_path: Path, n: int = 4, **changes) -> tuple[Path, list[Path]]:
    return make_federation(tmp_path, n, Settings(**(BASE | changes)))


def _data(node: Path) -> tuple[NodeData, str]:
    path = next(node.glob("data-*.pt"))
    index, total = path.stem.rsplit("-", 1)[1].split("of")
    return NodeData.load(path), f"{index}/{total}"


def _raw(task, w: np.ndarray, node: Path) -> torch.Tensor:
    """The float32 row ``node`` computes for ``task`` before any encoding."""
    data, _ = _data(node)
    return compute(task, torch.from_numpy(w), data.x, data.y, data.classes, fingerprint(node), CPU)[0]


def _answer(task, w: np.ndarray, node: Path):
    data, part = _data(node)
    return work(task, w, data, keys.load_private(node), CPU, folder=node, part=part)


def _proto(content: RecordDict) -> RecordDict:
    """What the ServerApp receives: the message after Flower's protobuf round trip."""
    return recorddict_from_proto(recorddict_to_proto(content))


@pytest.mark.parametrize("spec", CODECS)
def test_a_reply_decodes_at_the_coordinator_to_the_codecs_own_decoding(tmp_path, spec):
    coord_dir, nodes = _federation(tmp_path, compression=spec)
    coord, codec = Coordinator(coord_dir), codecs.build(spec)
    task, w = coord.task()
    d = w.size
    assert task.compression == spec and read_task(_proto(task_content(task, w)))[0] == task
    inbox = Inbox()
    for (fp, content), node in zip(replies(coord, nodes), nodes):
        sent = _proto(content)
        names = sorted(sent.array_records[UPDATE])
        assert names == (["row"] if spec == "none" else sorted(codec.layout(d)))
        take(coord, fp, sent, inbox)
        raw = _raw(task, w, node)
        expected = raw if spec == "none" else codec.decode(codec.encode(raw, (task.seed, task.round, fp)), d)
        assert torch.equal(inbox.rows[fp], expected), spec  # the very bits the node signed
    record = coord.finish_round(sorted(inbox.rows), inbox, 0.0)
    assert record["accepted"] == 4 and not record["rejected"]


def test_topk_keeps_its_residual_across_rounds_and_a_round_asked_again_gives_the_same_bits(tmp_path):
    spec = "topk:k=0.01"
    coord_dir, nodes = _federation(tmp_path, compression=spec, rounds=3)
    coord, codec, node = Coordinator(coord_dir), codecs.build(spec), nodes[0]
    fp = fingerprint(node)
    task1, w1 = coord.task()
    _, e1 = codecs.error_feedback(codec, _raw(task1, w1, node), None, (task1.seed, 1, fp))
    play(coord, nodes)
    task2, w2 = coord.task()
    d = w2.size
    assert torch.equal(load_residual(node, task2, codec, d), e1) and float(e1.norm()) > 0
    enc2, e2 = codecs.error_feedback(codec, _raw(task2, w2, node), e1, (task2.seed, 2, fp))

    def decoded(answer) -> torch.Tensor:
        reply, sent = answer
        _, row, _ = read_reply(_proto(reply_content(reply, sent)), d, codec)
        return torch.from_numpy(row)

    first, again = _answer(task2, w2, node), _answer(task2, w2, node)  # round 2 asked twice
    assert torch.equal(decoded(first), codec.decode(enc2, d)) and torch.equal(decoded(again), decoded(first))
    assert all(np.array_equal(first[1][k], again[1][k]) for k in enc2)
    assert torch.equal(load_residual(node, dataclasses.replace(task2, round=3), codec, d), e2)
    inbox = Inbox()
    take(coord, fp, reply_content(*first), inbox)
    assert fp in inbox.rows  # signed over the decoded row
    third = _answer(dataclasses.replace(task2, round=3), w2, node)  # round 3 builds on round 2's residual
    assert not torch.equal(decoded(third), decoded(first))
    back = _answer(task2, w2, node)  # round 2 after round 3: refused, like the momentum
    assert back[1] is None and "went back in time" in back[0].refused
    other = _answer(dataclasses.replace(task2, round=4, compression="topk:k=0.02"), w2, node)
    assert other[1]["idx"].size == 97  # another codec starts from no residual, without complaint


def _mutated(sent: dict, change: str, d: int) -> dict:
    """An honest encoding (``sent``) broken one way."""
    out = dict(sent)
    first = next(iter(sent))
    if change == "renamed":
        out["x" if first != "x" else "y"] = out.pop(first)
    elif change == "missing":
        out.pop(next(k for k in sent if k != first))
    elif change == "extra":
        out["more"] = np.zeros(3, np.float32)
    elif change == "uncompressed":
        out = {"row": np.zeros(d, np.float32)}
    elif change == "dtype":
        out[first] = sent[first].view(f"u{sent[first].dtype.itemsize}")  # as many bytes, another type
    elif change == "big-endian":
        out[first] = sent[first].astype(sent[first].dtype.newbyteorder(">"))
    elif change == "short":
        out[first] = sent[first][:-1]
    elif change == "-128":
        out["q"] = sent["q"].copy()
        out["q"][0] = -128
    elif change == "nan-scale":
        out["scale"] = sent["scale"].copy()
        out["scale"][0] = np.nan
    elif change == "negative-scale":
        out["scale"] = sent["scale"].copy()
        out["scale"][0] = -1.0
    elif change == "index-out":
        out["idx"] = sent["idx"].copy()
        out["idx"][-1] = d
    elif change == "index-negative":
        out["idx"] = sent["idx"].copy()
        out["idx"][0] = -1
    elif change == "index-repeated":
        out["idx"] = sent["idx"].copy()
        out["idx"][1] = out["idx"][0]
    elif change == "index-unsorted":
        out["idx"] = sent["idx"][::-1].copy()
    elif change == "inf-value":
        out["val"] = sent["val"].copy()
        out["val"][0] = np.inf
    elif change == "overflow":
        out["val"] = np.full_like(sent["val"], np.finfo(np.float32).max)
    return out


MALFORMED = {
    "int8": {"renamed": "expected ['q', 'scale'] (compression int8:block=256)",
             "missing": "update has arrays ['q'], expected ['q', 'scale']",
             "extra": "'more'", "uncompressed": "update has arrays ['row']",
             "dtype": "update array 'q' bytes hold uint8, labelled uint8: expected int8",
             "short": "update array 'q' bytes hold shape (4809,), expected (4810,)",
             "-128": "int8 array 'q' holds -128", "nan-scale": "int8 array 'scale' holds NaN or Inf",
             "negative-scale": "holds negative values",
             # faults' lies are sized for float32: an int8 array's lies are caught by its byte cap
             "dtype-lie": "update array 'q' is 19368 bytes", "shape-lie": "update array 'q' is 19372 bytes",
             "oversize": "update array 'q' is 307968 bytes, (4810,) int8 takes at most 5834",
             "nan": "int8 array 'scale' holds NaN or Inf", "wrong-shape": "bytes hold shape (4811,)"},
    "fp16": {"big-endian": "update array 'x' bytes hold >f2",
             "nan": "fp16 array 'x' holds NaN or Inf", "huge-norm": "above the bound"},
    "topk:k=0.01": {"index-out": "'idx' holds indices outside [0, 4810)", "index-negative": "indices outside",
                    "index-repeated": "repeats an index", "index-unsorted": "not sorted ascending",
                    "inf-value": "topk array 'val' holds NaN or Inf", "short": "shape (48,), expected (49,)"},
    "randk:k=0.01": {"overflow": "decodes to non-finite values", "index-out": "indices outside"},
}
FAULTS = ("nan", "wrong-shape", "huge-norm", "dtype-lie", "shape-lie", "oversize")  # the volunteer's own faults


@pytest.mark.parametrize("spec", list(MALFORMED))
def test_malformed_encodings_are_rejected_with_their_reason(tmp_path, spec, caplog):
    coord_dir, nodes = _federation(tmp_path, compression=spec, rounds=1)
    coord = Coordinator(coord_dir)
    task, w = coord.task()
    d = w.size
    honest = replies(coord, nodes[1:])
    reply, sent = _answer(task, w, nodes[0])
    fp = fingerprint(nodes[0])
    for change, words in MALFORMED[spec].items():
        if change in FAULTS:
            data, part = _data(nodes[0])
            r, s = work(task, w, data, keys.load_private(nodes[0]), CPU, change, nodes[0], part)
            content = wire_content(change, r, s)
        else:
            content = reply_content(reply, _mutated(sent, change, d))
        inbox = Inbox()
        take(coord, fp, _proto(content), inbox)
        assert not inbox.rows and words in inbox.rejected.get(fp, ""), (change, inbox.rejected)
    inbox = Inbox()
    for other, content in honest:
        take(coord, other, content, inbox)
    take(coord, fp, reply_content(reply, _mutated(sent, "renamed", d)), inbox)
    with caplog.at_level(logging.WARNING, logger="robust.coordinator"):
        record = coord.finish_round(coord.select([fingerprint(n) for n in nodes]), inbox, 0.0)
    assert record["accepted"] == 3 and not record["skipped"] and record["rejected"][fp].startswith("malformed reply:")
    assert f"rejected {fp[:12]}: malformed reply: update has arrays" in caplog.text


def test_a_byzantine_node_may_send_anything_that_decodes(tmp_path):
    coord_dir, nodes = _federation(tmp_path, compression="int8", rounds=1)
    coord = Coordinator(coord_dir)
    task, w = coord.task()
    reply, sent = _answer(task, w, nodes[0])
    forged = {"q": np.full_like(sent["q"], 127), "scale": np.full_like(sent["scale"], 1e-3)}
    row = codecs.build("int8").decode(forged, w.size)
    signature = keys.sign(keys.load_private(nodes[0]), reply_payload(reply, sha256(row)))
    reply = dataclasses.replace(reply, signature=signature)
    inbox, fp = Inbox(), fingerprint(nodes[0])
    take(coord, fp, _proto(reply_content(reply, forged)), inbox)
    assert torch.equal(inbox.rows[fp], row)  # well formed and signed: the statistics' business, not the wire's
    other = keys.sign(keys.load_private(nodes[0]), reply_payload(reply, sha256(row * 2)))
    unsigned = dataclasses.replace(reply, signature=other)
    inbox = Inbox()
    take(coord, fp, reply_content(unsigned, forged), inbox)
    assert inbox.rejected == {fp: "bad signature"}  # the signature covers the decoded row


def test_a_signed_reply_on_another_tasks_support_is_rejected_with_the_reason(tmp_path):
    """A node that encodes on the coordinates of another task (the next one, or a run of its
    own seed) and signs what that decodes to: well formed and signed, its claim is what betrays it."""
    coord_dir, nodes = _federation(tmp_path, compression="shared-sign", rounds=1)
    coord, codec = Coordinator(coord_dir), codecs.build("shared-sign")
    task, w = coord.task()
    reply, _ = _answer(task, w, nodes[0])
    fp, raw = fingerprint(nodes[0]), _raw(task, w, nodes[0])
    for key in ((task.seed, task.round + 1, fp), (task.seed + 1, task.round, fp)):
        lie = codec.encode(raw, key)
        signed = dataclasses.replace(reply, signature=keys.sign(keys.load_private(nodes[0]),
                                                                reply_payload(reply, sha256(codec.decode(lie, w.size)))))
        inbox = Inbox()
        take(coord, fp, _proto(reply_content(signed, lie)), inbox)
        assert not inbox.rows and "update encoded on another task's support" in inbox.rejected[fp]
        assert f"task {task.round}'s is" in inbox.rejected[fp]
    inbox = Inbox()
    take(coord, fp, _proto(reply_content(*_answer(task, w, nodes[0]))), inbox)
    assert fp in inbox.rows and not inbox.rejected  # its own task's support: accepted


def test_bytes_are_recorded_and_int8_is_about_4x_smaller(tmp_path):
    sizes = {}
    for spec in ("none", "int8", "topk:k=0.01"):
        coord_dir, nodes = _federation(tmp_path / spec.split(":")[0], compression=spec, rounds=1)
        record = play(Coordinator(coord_dir), nodes)
        lines = (coord_dir / checkpoint.ROUNDS).read_text().splitlines()
        assert json.loads(lines[-1])["bytes_up"] == record["bytes_up"]
        per_node = record["bytes_per_node"]
        assert sorted(per_node) == sorted(fingerprint(n)[:12] for n in nodes)
        assert record["bytes_up"] == sum(up for up, _ in per_node.values())
        assert record["bytes_down"] == sum(down for _, down in per_node.values()) == 4 * (4 * 4810 + 128)
        sizes[spec] = record["bytes_up"] / 4
    assert sizes["none"] == 4 * 4810 + 128  # the float32 row's .npy bytes
    assert 3.5 < sizes["none"] / sizes["int8"] < 4 and sizes["none"] / sizes["topk:k=0.01"] > 25


def test_spot_check_with_topk_is_refused_in_one_line_and_a_verifier_refuses_it_too(tmp_path):
    with pytest.raises(ValueError, match=r"^spot-check=0.5 cannot check compression='topk:k=0.01': .*"
                                         r"use fp16, int8 or randk, or spot-check=0$"):
        Settings(spot_check=0.5, compression="topk:k=0.01")
    for spec in ("fp16", "int8", "randk:k=0.05"):
        Settings(spot_check=0.5, compression=spec)
    coord_dir, nodes = _federation(tmp_path, compression="topk:k=0.01", rounds=1)
    task, w = Coordinator(coord_dir).task()
    reply, row = check(task, w, fingerprint(nodes[0]), "1/4", lambda d, p: _data(nodes[0])[0],
                       keys.load_private(nodes[1]), CPU)
    assert row is None and "error-feedback residual" in reply.refused


def _checkers(nodes: list[Path]) -> Checkers:
    """Verifiers that answer as ``robust node join``'s ClientApp does."""
    by_fp = {fingerprint(n): n for n in nodes}

    def ask(asked):
        out = {}
        for author, (verifier, content) in asked.items():
            folder = by_fp[verifier]
            task, w, (who, part) = read_task(_proto(content))
            reply, row = check(task, w, who, part, lambda d, p: NodeData.load(prepare_data(folder, d, None, p)),
                               keys.load_private(folder), CPU)
            out[author] = _proto(reply_content(reply, row))
        return out

    return Checkers(sorted(by_fp), ask)


@pytest.mark.parametrize("spec", ["fp16", "int8", "randk:k=0.01"])
def test_spot_checks_recompute_compressed_updates_and_the_audit_verifies(tmp_path, spec):
    coord_dir, nodes = _federation(tmp_path, compression=spec, spot_check=1.0, verifier="nodes", rounds=2)
    coord = Coordinator(coord_dir)
    forger = fingerprint(nodes[3])
    first = play(coord, nodes, {4: "forge:scale=0.9"}, checkers=_checkers(nodes))
    assert first["convicted"] == [forger]
    verdicts = {v["author"]: v for v in first["spot"]}
    assert all(v["distance"] == 0.0 and not v["guilty"] and v["check"] for a, v in verdicts.items() if a != forger)
    assert verdicts[forger]["guilty"] == [forger] and verdicts[forger]["note"] == "refereed by the coordinator"
    second = play(coord, nodes, checkers=_checkers(nodes))
    assert not second["convicted"] and second["accepted"] == 3
    assert audit.verify(coord_dir) == ([], 2, True)


@pytest.mark.parametrize("spec", ["topk:k=0.01", "shared-sign"])
def test_the_audit_verifies_a_run_of_a_biased_codec(tmp_path, spec):
    coord_dir, nodes = _federation(tmp_path, compression=spec, rounds=3)
    coord = Coordinator(coord_dir)
    while not coord.done:
        record = play(coord, nodes)
    assert record["accepted"] == 4 and audit.verify(coord_dir) == ([], 3, True)
    # what is kept is what the nodes sent, at the codec's size, named by the decoded row each signed
    # (shared-sign's decodes on the support its claim names, with no task at hand)
    codec, d = codecs.build(spec), coord.engine.w.numel()
    stored = sorted((coord_dir / audit.UPDATES).glob("*"))
    assert len(stored) == 3 * 4 and {p.suffix for p in stored} == {".npz"}
    for update in stored:
        with np.load(update, allow_pickle=False) as npz:
            enc = {name: npz[name] for name in npz.files}
        assert sha256(codec.decode(enc, d)) == update.stem
        assert update.stat().st_size < codec.nbytes(d) + 1024 < 4 * d / 5


def test_an_fp16_downlink_halves_the_bytes_down_and_nodes_checks_and_audit_follow_the_rounded_model(tmp_path):
    coord_dir, nodes = _federation(tmp_path, downlink="fp16", spot_check=1.0, verifier="nodes", rounds=2)
    coord = Coordinator(coord_dir)
    task, w = coord.task()
    sent = read_task(_proto(task_content(task, w)))[1]
    assert sent.dtype == np.float16 and torch.equal(torch.from_numpy(sent).float(), coord.engine.w.half().float())
    assert sha256(torch.from_numpy(sent.astype(np.float32))) == task.base != coord.engine.base
    forger = fingerprint(nodes[3])
    first = play(coord, nodes, {4: "forge:scale=0.9"}, checkers=_checkers(nodes))
    assert first["convicted"] == [forger] and first["accepted"] == 3  # honest checks agree on the rounded model
    assert first["bytes_down"] == 4 * (2 * 4810 + 128) and first["task_sha256"] == coord.task()[0].base
    play(coord, nodes, checkers=_checkers(nodes))
    assert audit.verify(coord_dir) == ([], 2, True)
