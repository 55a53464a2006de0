"""What a volunteer does with a task, with no Flower in sight: check it, train (the engine's
:func:`~nodes.engine.training.compute`), sign.

Under the ``momentum`` protocol a node keeps its worker momentum between rounds, in its
folder (``state/<run>.pt``: the momentum before and after the last round it computed), so a
coordinator that is restarted and asks the same round again gets the same row. A test node
whose attack remembers its previous round (``lazy``'s update, ``neurotoxin``'s model, ``a3fl``'s trigger) keeps
that :class:`~attacks.base.Memory` the same way (``state/<run>.last.pt``, before and after).

A node encodes its row with the task's codec (``compression``; ``robust.codecs``) and sends the
encoding; it signs the SHA-256 of the row the encoding *decodes* to (decoding is deterministic),
which is the row the coordinator aggregates, logs and stores. A biased codec (``topk``) is
encoded with error feedback: the residual is per-run node state kept like the momentum
(``state/<run>.residual.pt``, before and after the last round computed, with the codec's spec:
another codec starts from no residual). A keyed codec (``randk``) draws from ``(run seed,
round, node fingerprint)``, the bench's key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import attacks
from attacks.base import Memory, NodeAttack
from robust.user_code import use_path
from robust.compute import resolve_device
from robust import codecs, keys
from robust.codecs import Codec, Encoded
from robust.data import load
from robust.params import sha256

from ..checkpoint import write_atomic
from ..engine.committed import author
from ..engine.protocol import Protocol
from ..engine.spotcheck import profile_of
from ..engine.states import ZERO
from ..engine.training import NodeData, compute, estimates, parse_part, part_of, playing
from ..wire import Reply, Task, claim_payload, refusal, reply_payload
from . import faults, memory

STATE, CONFIG = "state", "node.json"


@dataclass(frozen=True)
class NodeConfig:
    """How a node works (``DIR/node.json``, written by ``robust node join`` or a bench driver):
    its prepared data file, device, and for a Byzantine test node its attack and delay."""

    data: str
    device: str = "auto"
    attack: str = ""
    slow: float = 0.0  # seconds: each reply waits a random 0..slow
    part: str = ""  # the part of the data set it holds: I/N (iid, seed 0), or I/N;KIND:alpha=A,seed=S (a bench's split)
    data_root: str = ""  # the folder of local data files, to prepare parts for spot checks
    code: str = ""  # the folder of the volunteer's own modules (a loader package.module:load), on its import path

    def save(self, folder: Path) -> None:
        write_atomic(folder / CONFIG, lambda out: out.write((json.dumps(asdict(self)) + "\n").encode()))

    @classmethod
    def load(cls, folder: Path) -> NodeConfig:
        return cls(**json.loads((folder / CONFIG).read_text()))


def prepare_data(folder: Path, dataset: str, root: str | None, part: str, code: str = "") -> Path:
    """This node's part (``I/N``) of ``dataset``, saved in its folder once; the per-round
    ClientApp processes load only that file. ``code``: the folder of a user's loader."""
    index, total = parse_part(part)
    split = re.sub(r"[^A-Za-z0-9._-]", "_", part.partition(";")[2])  # another split than iid seed 0: its own file
    path = folder / f"data-{re.sub(r'[^A-Za-z0-9._-]', '_', dataset)}-{index}of{total}{'-' + split if split else ''}.pt"
    if not path.exists():
        if code:
            use_path(code)
        part_of(load(dataset, root=root, seed=0), part).save(path)
    return path


def pick_device(choice: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; ``cuda`` without a GPU is an error."""
    return resolve_device(choice, "--device ")


def check_attack(spec: str) -> None:
    """Raise ``ValueError`` unless ``spec`` is a protocol fault or a node-side attack."""
    if spec in ("", "none") or spec in faults.PROTOCOL_FAULTS:
        return
    if not isinstance(attacks.build(spec, 1), NodeAttack):
        raise ValueError(
            f"{spec!r} is an omniscient attack (it needs every node's update): a volunteer can play "
            f"node-side attacks ({', '.join(n for n in attacks.names() if isinstance(attacks.build(n, 1), NodeAttack))}) "
            f"or protocol faults ({', '.join(faults.PROTOCOL_FAULTS)})"
        )


def forge(attack: str, row: torch.Tensor, last: Memory | None, round: int,
          own: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """What a node playing ``attack`` sends in ``round`` for the update ``row`` it computed
    (``last``: what it kept of its previous round, for an attack that
    :attr:`~attacks.base.NodeAttack.remembers`; ``own(K)``: the node's ``K`` more honest rows,
    for an attack with :attr:`~attacks.base.NodeAttack.estimates`, computed only then)."""
    played = playing(attack, round)
    if played is None:
        return row
    return played.forge(row, None if last is None else last.row,
                        own(played.estimates) if played.estimates and own is not None else None)


def _state_path(folder: Path, run: str) -> Path:
    return folder / STATE / (re.sub(r"[^A-Za-z0-9._-]", "_", run) + ".pt")


KEPT = 4  # named momenta a node keeps (nodes.engine.states): the one its last task named and those sent since


def load_momentum(folder: Path, task: Task, d: int) -> torch.Tensor | str:
    """The node's worker momentum before ``task``'s round: the one the task names
    (``nodes.engine.states``), or its own as it carried it; or why it cannot be had."""
    if task.state == ZERO:
        return torch.zeros(d)
    if task.state:
        path = _state_path(folder, task.run).with_suffix(".named.pt")
        m = (torch.load(path, weights_only=True) if path.exists() else {}).get(task.state)
        if m is None:
            return (f"this node does not hold the momentum its task continues from ({task.state[:12]}): it keeps "
                    f"the momentum of its last {KEPT} rows sent, so its folder was replaced or the coordinator "
                    "went back further (a restored checkpoint?)")
        return m if m.numel() == d else f"this node's momentum has {m.numel()} values, the model {d}"
    path = _state_path(folder, task.run)
    if not path.exists():
        return torch.zeros(d)
    state = torch.load(path, weights_only=True)
    if state["round"] > task.round:
        return (f"this node's momentum is from round {state['round']} of run {task.run}, the task is round "
                f"{task.round}: the coordinator went back in time (a restored folder?)")
    m = state["before"] if state["round"] == task.round else state["after"]  # the same round asked again
    return m if m.numel() == d else f"this node's momentum has {m.numel()} values, the model {d}"


def save_momentum(folder: Path, task: Task, before: torch.Tensor, after: torch.Tensor) -> None:
    path = _state_path(folder, task.run)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda out: torch.save({"round": task.round, "before": before, "after": after}, out))


def keep_named(folder: Path, task: Task, after: torch.Tensor, sent: str) -> None:
    """Keep ``after``, the momentum this node holds once it sent the row whose SHA-256 is
    ``sent``: a later task names it if a round used that row (``nodes.engine.states``). The
    momentum ``task`` named is kept too, for a task that names it again (a row not used)."""
    path = _state_path(folder, task.run).with_suffix(".named.pt")
    kept = torch.load(path, weights_only=True) if path.exists() else {}
    named = kept.pop(task.state, None)
    if named is not None:
        kept[task.state] = named  # the newest but one
    kept[sent] = after
    kept = dict(list(kept.items())[-KEPT:])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda out: torch.save(kept, out))


def load_residual(folder: Path, task: Task, codec: Codec, d: int) -> torch.Tensor | None | str:
    """The node's error-feedback residual before ``task``'s round (``None``: none yet, or one
    kept for another codec or model), or why it cannot be had."""
    path = _state_path(folder, task.run).with_suffix(".residual.pt")
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True)
    if state["round"] > task.round:
        return (f"this node's error-feedback residual is from round {state['round']} of run {task.run}, the task is "
                f"round {task.round}: the coordinator went back in time (a restored folder?)")
    if state["codec"] != codec.spec:
        return None
    e = state["before"] if state["round"] == task.round else state["after"]  # the same round asked again
    return e if e is None or e.shape == (d,) else None


def save_residual(folder: Path, task: Task, codec: Codec, before: torch.Tensor | None, after: torch.Tensor) -> None:
    path = _state_path(folder, task.run).with_suffix(".residual.pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda out: torch.save({"round": task.round, "codec": codec.spec, "before": before,
                                               "after": after}, out))


def encode_update(codec: Codec, row: np.ndarray, key: tuple, residual: torch.Tensor | None = None,
                  d: int | None = None) -> tuple[Encoded, np.ndarray, torch.Tensor | None]:
    """``(encoding, the row it decodes to, new residual)`` of the row a node sends; with error
    feedback (a biased ``codec``) from ``residual`` when the row has the model's ``d`` values.
    A test node's broken row travels broken, for the coordinator to reject: a non-finite row
    as an encoding holding NaN (its ``row`` is what is signed), a wrong length as encoded."""
    t = torch.from_numpy(np.ascontiguousarray(row, dtype=np.float32))
    if not bool(torch.isfinite(t).all()):
        enc = codec.encode(torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0), key)
        name = next(n for n, a in enc.items() if a.dtype.kind == "f")
        enc[name] = enc[name].copy()
        enc[name][0] = np.nan
        return enc, row, residual
    after = residual
    if codec.biased and t.numel() == d:
        enc, after = codecs.error_feedback(codec, t, residual, key)
    else:
        enc = codec.encode(t, key)
    return enc, codec.decode(enc, t.numel()).numpy(), after


def _remembers(folder: Path | None, attack: str) -> bool:
    return folder is not None and attack not in ("", "none") and attacks.build(attack, 1).remembers


def recall(folder: Path | None, task: Task, attack: str, d: int) -> Memory | None:
    """For an attack that remembers: what the node kept of the last round it computed before
    ``task``'s (``state/<run>.last.pt``); ``None`` in its first round, or for a memory that
    does not fit (another model, a coordinator gone back in time)."""
    state = _last_state(folder, task.run) if _remembers(folder, attack) else None
    if state is None:
        return None
    after = state["after"]
    kept = state["before"] if after["round"] == task.round else after if after["round"] < task.round else None
    if not isinstance(kept, dict) or kept["row"].shape != (d,) or kept["w"].shape != (d,):
        return None
    return _memory(kept)


def last_kept(folder: Path, run: str) -> Memory | None:
    """What a node kept of the last round it computed in run ``run`` (``state/<run>.last.pt``),
    if anything: where a bench driver of real volunteers reads an attacker's last trigger."""
    state = _last_state(folder, run)
    return None if state is None else _memory(state["after"])


def _last_state(folder: Path, run: str) -> dict | None:
    """The node's ``state/<run>.last.pt`` (``{"before", "after"}``), if it holds one."""
    path = _state_path(folder, run).with_suffix(".last.pt")
    state = torch.load(path, weights_only=True) if path.exists() else None
    return state if isinstance(state, dict) and isinstance(state.get("after"), dict) else None


def _memory(kept: dict) -> Memory:
    trigger = kept.get("trigger")  # an adaptive backdoor's (a3fl)
    return Memory(int(kept["round"]), kept["w"], kept["row"],
                  trigger=trigger if isinstance(trigger, torch.Tensor) else None)


def remember(folder: Path | None, task: Task, attack: str, before: Memory | None, w: torch.Tensor,
             row: torch.Tensor, kept: dict | None = None) -> None:
    """Keep this round (the model ``w`` sent, the update ``row`` computed, what its poisoning
    ``kept``: ``Memory.after``) for the next, with the memory it started from (``before``): the
    same round asked again recalls that one."""
    if not _remembers(folder, attack):
        return
    path = _state_path(folder, task.run).with_suffix(".last.pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    trigger = Memory.after(task.round, w, row, kept or {}, before).trigger
    state = {"before": None if before is None else dataclasses.asdict(before),
             "after": {"round": task.round, "w": w, "row": row, "trigger": trigger}}
    write_atomic(path, lambda out: torch.save(state, out))


def sign(reply: Reply, key, update_sha: str) -> Reply:
    """``reply`` signed with the node's ``key`` for an update of SHA-256 ``update_sha``."""
    return dataclasses.replace(reply, signature=keys.sign(key, reply_payload(reply, update_sha)))


def work(task: Task, w: np.ndarray, data: NodeData, key, device: torch.device,
         attack: str = "", folder: Path | None = None, part: str = "") -> tuple[Reply, np.ndarray | Encoded | None]:
    """The signed reply to ``task`` with global weights ``w`` (or a refusal saying why), and
    the update as it travels: the float32 row (codec ``none``) or its encoding.
    ``folder`` keeps the node's worker momentum, its error-feedback residual (and a replaying
    test node's last reply); ``part`` is the part of the data set ``data`` is, declared (and
    signed) with the update."""

    if attack == "decline":
        return refusal(task, faults.DECLINE), None
    if task.dataset != data.dataset:
        return refusal(task, f"this node holds {data.dataset}, the task trains on {task.dataset}: rejoin with --data {task.dataset}"), None
    if task.data_sha256 and task.data_sha256 != data.sha256:
        return refusal(task, f"this node's {data.dataset} is not the coordinator's (SHA-256 {data.sha256[:12] or 'unknown'}, "
                             f"the task's {task.data_sha256[:12]}): another Python version's standard library, or "
                             "other files; rejoin with the coordinator's"), None
    weights = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    if sha256(weights) != task.base:
        return refusal(task, "the model received does not match its announced SHA-256"), None
    node = keys.fingerprint(key.public_key())
    played = "" if attack in faults.PROTOCOL_FAULTS else attack  # a protocol fault trains honestly
    try:
        keeps = Protocol.of(task).keeps_momentum
    except ValueError as err:
        return refusal(task, f"protocol: {err}"), None
    short = memory.shortfall(task, weights.numel())
    if short:  # declined before it is started, not killed by the kernel halfway
        return refusal(task, short), None
    try:
        codec = codecs.build(task.compression)
    except ValueError as err:
        return refusal(task, f"compression: {err}"), None
    d = weights.numel()
    residual = None
    if codec.biased:
        if folder is None:
            return refusal(task, f"compression {codec.spec} keeps an error-feedback residual: the node needs a folder"), None
        residual = load_residual(folder, task, codec, d)
        if isinstance(residual, str):
            return refusal(task, residual), None
    m = None
    if keeps:
        if folder is None:
            return refusal(task, "the momentum protocol needs a node folder to keep its momentum in"), None
        m = load_momentum(folder, task, weights.numel())
        if isinstance(m, str):
            return refusal(task, m), None
    last, kept = recall(folder, task, played, weights.numel()), {}
    start = time.perf_counter()
    attacking = playing(played, task.round)
    k = attacking.estimates if attacking is not None else 0
    # an attack's estimates (its own honest rows) are computed first and wait on disk while the
    # node trains its own row: it holds one model-sized row at a time, not K + 1
    with tempfile.TemporaryDirectory(prefix="robust-estimates-") if k else contextlib.nullcontext() as spool:
        try:
            ready = estimates(task, weights, data.x, data.y, data.classes, node, device, m, k, Path(spool)) if k else None
            if keeps:  # its state carries over rounds: no trajectory from the task alone to commit to
                computed, after = compute(task, weights, data.x, data.y, data.classes, node, device, played, m, last,
                                          kept=kept)
                delta, root = forge(played, computed, last, task.round, lambda k: ready), ""
            else:  # it commits to the trajectory it claims (nodes.engine.committed)
                authored, computed = author(task, weights, data.x, data.y, data.classes, node, device, played, m,
                                            last, own=lambda k: ready, kept=kept)
                delta, after, root = authored.row, authored.m, authored.root
        except ValueError as err:  # the weights do not fit the model on this data
            return refusal(task, f"model {task.model} on {data.dataset}: {err}"), None
    seconds = time.perf_counter() - start
    if keeps and not task.state:
        save_momentum(folder, task, m, after)
    remember(folder, task, played, last, weights, computed, kept)
    row = faults.corrupt_row(attack, delta.numpy())
    sent, signed = row, row  # codec none: the row itself
    code_key = (task.seed, task.round, node)
    if codec.name != "none":
        sent, signed, after_residual = encode_update(codec, row, code_key, residual, d)
        if codec.biased:
            save_residual(folder, task, codec, residual, after_residual)
    count, base = faults.corrupt_fields(attack, len(data.y), task.base)
    reply = Reply(run=task.run, round=task.round, base=base, count=count, signature=b"", seconds=seconds,
                  part=part, profile=profile_of(device), root=root)
    signed_sha = sha256(torch.from_numpy(signed))
    reply = sign(reply, key, signed_sha)
    if keeps and task.state:
        keep_named(folder, task, after, signed_sha)
    if folder is not None:
        reply, again = faults.corrupt_reply(attack, reply, signed, folder)
        if again is not signed:  # a replayed (decoded) row: sent again as the codec carries it
            sent = again if codec.name == "none" else encode_update(codec, again, code_key)[0]
    return reply, sent


def check(task: Task, w: np.ndarray, author_fp: str, part: str, data_of: Callable[[str, str], NodeData], key,
          device: torch.device) -> tuple[Reply, np.ndarray | Encoded | None]:
    """A spot check: node ``author_fp``'s update for ``task`` recomputed as it should have computed
    it (on its data ``part``, with its batch draws, encoded with the task's codec and the
    author's key), signed by this node; a refusal saying why if this node cannot
    (``data_of(dataset, part)`` raises ``ValueError``: data it cannot get; a biased codec,
    whose error-feedback residual is the author's own state)."""
    weights = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    if sha256(weights) != task.base:
        return refusal(task, "the model received does not match its announced SHA-256", author_fp), None
    try:
        short = memory.shortfall(task, weights.numel())
        if short:
            return refusal(task, short, author_fp), None
        if Protocol.of(task).keeps_momentum:
            return refusal(task, "a momentum-protocol update is recomputed by the coordinator, which holds the "
                                 "momentum its task named", author_fp), None
        codec = codecs.build(task.compression)
        if codec.biased:
            return refusal(task, f"a {codec.spec} update carries its author's error-feedback residual: it cannot "
                                 "be recomputed from its task", author_fp), None
        data = data_of(task.dataset, part)
        authored, row = author(task, weights, data.x, data.y, data.classes, author_fp, device)
    except ValueError as err:
        return refusal(task, f"cannot recompute {author_fp[:12]}'s update: {err}", author_fp), None
    sent = signed = row.numpy()
    if codec.name != "none":
        sent, signed, _ = encode_update(codec, signed, (task.seed, task.round, author_fp))
    reply = Reply(run=task.run, round=task.round, base=task.base, count=0, signature=b"", part=part,
                  profile=profile_of(device), author=author_fp, root=authored.root)
    return sign(reply, key, sha256(torch.from_numpy(signed))), sent


def answer_dispute(task: Task, w: np.ndarray, author_fp: str, part: str, root: str, data: NodeData, key,
                   device: torch.device, attack: str = "", folder: Path | None = None
                   ) -> tuple[Reply, list[str], np.ndarray | None]:
    """This node's answer to a dispute over the work it signed with ``root`` for ``task``:
    its own update (``author_fp`` is itself; ``data`` its own, ``attack`` what it plays) or its
    spot check of ``author_fp``'s (``data``: that node's ``part``, recomputed honestly). It
    keeps no states: it recomputes them from the task, bit for bit on its own profile
    (``nodes.engine.committed``), and signs the states it answers with
    (``nodes.wire.claim_payload``, over the states as one flat vector). ``(reply, hashes, the
    (K + 1) x 2d states, flat)``, or a refusal."""
    weights = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    own_work = author_fp == keys.fingerprint(key.public_key())
    played = attack if own_work and attack not in faults.PROTOCOL_FAULTS else ""
    if sha256(weights) != task.base:
        return refusal(task, "the model received does not match its announced SHA-256", author_fp), [], None
    try:
        if Protocol.of(task).keeps_momentum:
            return refusal(task, "a momentum-protocol update commits to no trajectory", author_fp), [], None
        last = recall(folder, task, played, weights.numel()) if own_work else None
        authored, _ = author(task, weights, data.x, data.y, data.classes, author_fp, device, played, None, last,
                             answering=True)
    except ValueError as err:
        return refusal(task, f"cannot recompute the disputed work: {err}", author_fp), [], None
    claim = authored.claim()
    states = torch.cat([claim.states[i] for i in range(len(claim.hashes))]).numpy()  # flat, as it travels
    reply = Reply(run=task.run, round=task.round, base=task.base, count=0, signature=b"", part=part,
                  profile=profile_of(device), author=author_fp, root=root)
    signed = dataclasses.replace(reply, signature=keys.sign(key, claim_payload(reply, sha256(torch.from_numpy(states)))))
    return signed, claim.hashes, states
