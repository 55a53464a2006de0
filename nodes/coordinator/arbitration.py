"""The coordinator's side of a refereed dispute (``nodes.engine.referee``).

A spot check whose whole-update comparison fails across compute profiles (``nodes.engine.spotcheck``:
the node declared another profile than the one that recomputed it) does not convict at once: the
coordinator opens a dispute with the node whose signed row disagrees (the author, or a verifier
over its check). The dispute is a task of the ledger (kind ``dispute``): the task the work
answered, with the root the node signed; the node recomputes its states from that task
(``nodes.volunteer.volunteer.answer_dispute``) and answers with their hashes and the states,
signed (``nodes.wire.claim_payload``). The coordinator referees every step from the node's own
claimed states at its ``referee-profile`` (:class:`Referee`; ``nodes.engine.referee.settle``: the
float64-referenced bound and near-ties; a disagreement on one profile convicts without a dispute).

What the disputed update does meanwhile: the round waits for the dispute, up to
``dispute-deadline`` rounds' deadlines, as it waits for its spot checks. An honest node's update
then still counts in the round it answered (leaving it out until cleared would leave out most
updates of a GPU owner whose rows a CPU coordinator never reproduces bit for bit, a bias against
hardware), and no row is aggregated that a later ruling convicts: there is nothing to undo. The
engine stays a function of its inputs: the rulings are in the round's record, the claimed
states are kept as evidence (``DIR/updates``), and ``robust audit verify`` referees every dispute
again from them (:func:`replay`).

Nothing a node answers can raise: a malformed, badly signed or mismatched answer convicts the
node with the reason; no answer before the deadline convicts it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
from flwr.app import RecordDict

from robust import keys
from robust.codecs import Codec
from robust.params import sha256
from robust.profile_process import runner
from robust.profiles import Profile

from ..engine.ledger import DISPUTE
from ..engine.protocol import Protocol
from ..engine.referee import Claim, Ruling, settle
from ..engine.spotcheck import profile_of
from ..engine.training import NodeData, transmitted
from ..wire import Reply, Task, claim_payload, read_claim, task_content


@dataclass(frozen=True)
class Dispute:
    """The work a dispute is about: ``signer`` signed ``row`` with the trajectory ``root`` for
    ``owner``'s ``task`` (base ``w``) on its data ``part`` (``owner`` is the signer, or the
    author whose update the signer recomputed); ``profile``: the signer's declared one."""

    signer: str
    owner: str
    task: Task
    w: torch.Tensor
    part: str
    row: torch.Tensor
    root: str
    profile: str

    def content(self) -> RecordDict:
        return task_content(self.task, self.w.numpy(), (self.owner, self.part), dispute=self.root)


@dataclass(frozen=True)
class Referee:
    """Where the coordinator's recomputations run: ``run(fn, *args)`` (this process, or a
    process at its ``referee-profile``: ``robust.profile_process``) on ``device``."""

    run: Callable
    device: torch.device
    profile: str  # what its recomputations declare (nodes.engine.spotcheck.profile_of)

    @classmethod
    def of(cls, spec: str) -> Referee:
        profile = Profile.parse(spec)
        device = torch.device("cuda" if profile.kind == "cuda" else "cpu")
        run = runner(profile)
        return cls(run, device, run(profile_of, device))


def referee(disputes: dict[object, Dispute], ask, signers: dict, data_of, codec: Codec, keep, judge: Referee
            ) -> dict[object, dict]:
    """Ask every dispute's signer at once (``ask({key: (node, content)}, kind)``: the serve
    loop's gather), then referee each answer (``judge``): key -> the dispute's record (the
    ruling, what the node answered, its signature). ``signers``: fingerprint -> public key;
    ``data_of(part)``: a part of the coordinator's data; ``keep(tensor)``: stores evidence,
    returns its SHA-256."""
    asked = {key: (d.signer, d.content()) for key, d in disputes.items() if d.root}
    answers = ask(asked, DISPUTE) if asked else {}
    out = {}
    for key, d in disputes.items():
        got = answers.get(key, "no answer before the dispute's deadline") if d.root else "signed no trajectory root"
        claim, seen = _read(d, got, signers.get(d.signer)) if not isinstance(got, str) else (got, {})
        if isinstance(claim, str):
            ruling = Ruling(True, f"did not answer the dispute: {claim}" if d.root else claim)
        else:
            seen["row"] = keep(d.row)
            seen["sha256"] = keep(torch.cat([claim.states[i] for i in range(len(claim.hashes))]))
            ruling = decide(d, claim, data_of(d.part), codec, judge)
        out[key] = {"node": d.signer, "root": d.root, **seen, **ruling.record(), "referee": judge.profile}
    return out


def decide(d: Dispute, claim: Claim | None, data: NodeData, codec: Codec, judge: Referee) -> Ruling:
    """The ruling on dispute ``d`` from the answer ``claim`` (``None``: none), on the data the
    work was computed on: the referee's profile, every step."""
    return judge.run(settle, d.task, d.w, data.x, data.y, data.classes, d.owner, d.row, d.root, claim, judge.device,
                     sent=partial(_sent, codec, (d.task.seed, d.task.round, d.owner)))


def _sent(codec: Codec, key: tuple, raw: torch.Tensor) -> torch.Tensor:
    """What an honest row ``raw`` travels as (a module-level function: it crosses to the
    referee's process)."""
    return transmitted(codec, raw, key)


def _read(d: Dispute, content: RecordDict, key) -> tuple[Claim | str, dict]:
    """The signed claim in ``content``, or why it cannot be used; what the record keeps of it."""
    try:
        protocol = Protocol.of(d.task)
        reply, hashes, states = read_claim(content, d.w.numel(), protocol.steps, protocol.width)
    except Exception as err:  # noqa: BLE001 - untrusted input: a reason, never an exception
        return f"an unreadable answer ({str(err)[:160]})", {}
    if reply.refused:
        return f"declined: {reply.refused[:200]}", {}
    if (reply.run, reply.round, reply.base, reply.author, reply.root) != (
            d.task.run, d.task.round, d.task.base, d.owner, d.root):
        return "an answer about other work", {}
    tensor = torch.from_numpy(np.array(states))
    if key is None or not keys.verify(key, reply.signature, claim_payload(reply, sha256(tensor.reshape(-1)))):
        return "a badly signed answer", {}
    return Claim(hashes, {i: tensor[i] for i in range(len(hashes))}), {
        "hashes": hashes, "signature": reply.signature.hex(), "profile": reply.profile}


def replay(record: dict, d: Dispute, states: torch.Tensor, data: NodeData, codec: Codec, judge: Referee
           ) -> str | None:
    """A recorded dispute refereed again from the kept states of its answer (``None``: the same
    ruling), or what differs: ``robust audit verify``. (A dispute without a usable answer
    keeps no states: it convicts, which the audit checks by itself.)"""
    hashes = list(record.get("hashes") or [])
    if states.numel() != len(hashes) * Protocol.of(d.task).width * d.w.numel():
        return f"its kept states do not fit its {len(hashes)} hashes"
    rows = states.reshape(len(hashes), -1)
    again = decide(d, Claim(hashes, {i: rows[i] for i in range(len(hashes))}), data, codec, judge)
    if (again.guilty, _stem(again.reason), again.step) != (record["guilty"], _stem(record["reason"]), record["step"]):
        return f"refereed again: {again.reason!r}, the log says {record['reason']!r}"
    return None


def _stem(reason: str) -> str:
    """A ruling's reason without its figures (a gap's last digits follow the machine's BLAS)."""
    return reason.split(" (")[0]


def audit(record: dict, d: Dispute, key, load, data: NodeData, codec: Codec, judge: Referee | None) -> str | None:
    """``robust audit verify``'s check of one recorded dispute over the work ``d`` (its row left
    unset: it is read from the evidence): without a usable answer it must have convicted; with
    one, the answer's signature by the node's ``key`` must verify, its states and the row
    (``load(sha) -> tensor or what is wrong``) must be the kept ones, and ``judge`` must rule
    the same again (:func:`replay`; ``None``: the replay does not hold the task's model, an
    asynchronous buffer's stale one). ``None``: it holds; else what does not."""
    if "sha256" not in record:
        return None if record.get("guilty") is True else "it was cleared with no answer kept"
    reply = Reply(run=d.task.run, round=d.task.round, base=d.task.base, count=0, signature=b"", author=d.owner,
                  root=record["root"])
    if key is None or not keys.verify(key, bytes.fromhex(record.get("signature", "")), claim_payload(reply, record["sha256"])):
        return f"the signature of {str(record['node'])[:12]}'s answer does not verify"
    states, row = load(record["sha256"]), load(record.get("row", ""))
    for got in (states, row):
        if isinstance(got, str):
            return got
    if judge is None:
        return None
    return replay(record, replace(d, row=row, root=record["root"]), states, data, codec, judge)
