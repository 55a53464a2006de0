"""Asynchronous rounds in the deployment (``round = async``, FedBuff), late replies carried
(``late = carry``) and ``robust coordinator replay``. In-process: the coordinator's own methods
(``tasks``/``issue``/``receive``) and the ServerApp's loop (``serve``) on a fake grid whose volunteers run the real ``nodes.volunteer.volunteer.work``; one
loopback federation with a slow volunteer for real."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization

from nodes import checkpoint, launch
from nodes.coordinator import audit
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.server_app import FlowerTransport, serve
from nodes.engine.serve import Landed, Loop
from nodes.engine.clocks import WallClock
from nodes.engine.training import NodeData
from nodes.settings import Settings
from nodes.volunteer import faults
from nodes.volunteer.volunteer import work
from nodes.wire import read_task
from robust import keys

from .federation_kit import ask, fingerprint, make_federation

SETTINGS = Settings(rounds=4, round="async", buffer=3, aggregator="trimmed-mean", tolerate=1,
                    protocol="delta:steps=2", batch_size=16, compression="int8")
pytestmark = pytest.mark.filterwarnings("ignore:Field flwr.proto.Array.shape:DeprecationWarning")


def answer(node: Path, task, w: np.ndarray, attack: str = ""):
    """``node``'s reply to ``task`` as it goes on the wire."""
    part = next(node.glob("data-*.pt"))
    index, total = part.stem.rsplit("-", 1)[1].split("of")
    reply, row = work(task, w, NodeData.load(part), keys.load_private(node), torch.device("cpu"), attack, node,
                      f"{index}/{total}")
    return faults.content(attack, reply, row)


class FakeGrid:
    """Flower's ``Grid`` as the ServerApp uses it: node ``i`` answers its task ``pulls[i]`` pulls
    after it was sent (a node not in ``pulls`` never does); a node in ``held`` answers only
    once more tasks are pushed (a synchronous round's straggler, whose reply comes in the next);
    node ``i`` plays ``attacks[i]`` (a node-side attack or fault)."""

    def __init__(self, nodes: list[Path], pulls: dict[int, int], held: tuple[int, ...] = (),
                 attacks: dict[int, str] | None = None) -> None:
        self.nodes, self.pulls, self.held, self.ids, self.count = nodes, pulls, held, itertools.count(1), 0
        self.attacks = attacks or {}
        self.pending: dict[str, tuple[int, object]] = {}

    def get_nodes(self):
        for nid, node in enumerate(self.nodes, start=1):
            pem = keys.load_private(node).public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            yield SimpleNamespace(node_id=nid, status="online", public_key=pem)

    def release(self) -> None:
        """The held replies are ready at the next pull."""
        self.pending = {mid: (self.count if at == math.inf else at, *rest) for mid, (at, *rest) in self.pending.items()}

    def push_messages(self, messages) -> list[str]:
        self.release()
        out = []
        for m in messages:
            mid, nid = str(next(self.ids)), m.metadata.dst_node_id
            if m.metadata.message_type == "train" and nid in self.pulls:
                at = math.inf if nid in self.held else self.count + self.pulls[nid]
                self.pending[mid] = (at, nid, m.content)
            out.append(mid)
        return out

    def pull_messages(self, ids):
        """The replies ready now, each computed as it is pulled (a volunteer's training time is
        not the coordinator's)."""
        self.count += 1
        ready = [mid for mid in ids if mid in self.pending and self.pending[mid][0] <= self.count]
        out = []
        for mid in ready:
            _, nid, content = self.pending.pop(mid)
            task, w, _ = read_task(content)
            out.append(SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid, src_node_id=nid),
                                       content=answer(self.nodes[nid - 1], task, w, self.attacks.get(nid, "")),
                                       has_error=lambda: False))
        return out


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / checkpoint.ROUNDS).read_text().splitlines()]


def serve_fake(root: Path, settings: Settings, attacks: dict[int, str] | None = None) -> tuple[Path, list[Path]]:
    """An async run served on a fake grid: 5 volunteers, node1 twice as fast as nodes 2-4, node5
    never answers; node ``i`` plays ``attacks[i]``."""
    from flwr.supercore.task_identity import TaskIdentity  # a ServerApp's messages name their run

    coord_dir, nodes = make_federation(root, 5, settings)
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        serve(FakeGrid(nodes, {1: 1, 2: 2, 3: 2, 4: 2}, attacks=attacks), Coordinator(coord_dir), poll=0.0)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    return coord_dir, nodes


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return serve_fake(tmp_path_factory.mktemp("served"), SETTINGS)


def test_the_loop_fills_buffers_of_distinct_nodes_without_waiting_for_a_silent_one(served):
    coord_dir, nodes = served
    log = records(coord_dir)
    slow, fast = fingerprint(nodes[4]), {fingerprint(n) for n in nodes[:4]}
    assert [r["round"] for r in log] == [1, 2, 3, 4]
    for r in log:
        assert len(r["ids"]) == len(set(r["ids"])) == 3 and set(r["ids"]) <= fast and not r["skipped"]
        assert sorted(r["staleness"]) == r["ids"] and r["buffer"] == 3
        assert set(r["updates"]) == set(r["ids"]) and all(u["base"] and u["task"] for u in r["updates"].values())
    assert all(slow not in r["ids"] for r in log)
    # four fast nodes answer together: a reply of a node already in the buffer waits for the next one
    k = next(k for k, r in enumerate(log[:-1]) if r["held"])
    assert log[k]["held"][0] in log[k + 1]["ids"] and log[k]["held"][0] in log[k]["ids"]
    assert max(max(r["staleness"].values()) for r in log) >= 1
    tasks = [u["task"] for r in log for u in r["updates"].values()]
    assert len(tasks) == len(set(tasks))  # every task has its own number (it keys the node's batches)
    assert json.loads((coord_dir / checkpoint.RESULT).read_text())["rounds"] == 4


def test_replay_and_audit_verify_an_async_run_bit_for_bit(served, capsys):
    coord_dir, _ = served
    assert audit.replay_main(str(coord_dir)) == 0
    assert capsys.readouterr().out.strip() == "4 buffers replayed: every model SHA-256 matches"
    assert audit.main(str(coord_dir)) == 0  # signatures over each update's own task and base
    assert "4 rounds verified" in capsys.readouterr().out


def test_lookahead_tasks_carry_the_logged_extrapolated_model_which_replay_recomputes(tmp_path, capsys):
    coord_dir, _ = serve_fake(tmp_path / "run", dataclasses.replace(SETTINGS, lookahead=True, rounds=5))
    log = records(coord_dir)
    [first] = {u["base"] for u in log[0]["updates"].values()}  # the first tasks carry the initial model
    sent = [first] + [r["task_sha256"] for r in log]
    assert any(r["task_sha256"] != r["model_sha256"] for r in log)
    for t, r in enumerate(log, start=1):
        assert all(u["base"] == sent[t - 1 - r["staleness"][fp]] for fp, u in r["updates"].items())
    assert audit.replay_main(str(coord_dir)) == 0
    capsys.readouterr()
    lines = (coord_dir / checkpoint.ROUNDS).read_text().splitlines()
    record = json.loads(lines[-1])
    record["task_sha256"] = record["model_sha256"]  # claim the last tasks carried the plain model
    lines[-1] = checkpoint.line(record)
    (coord_dir / checkpoint.ROUNDS).write_text("\n".join(lines) + "\n")
    assert audit.replay_main(str(coord_dir)) == 1
    assert "task_sha256" in capsys.readouterr().out


def test_replay_detects_a_tampered_update_and_a_tampered_schedule(served, tmp_path, capsys):
    from robust.cli import main

    coord_dir, _ = served
    changed = shutil.copytree(coord_dir, tmp_path / "update")
    sha = records(changed)[1]["updates"][records(changed)[1]["ids"][0]]["sha256"]
    with np.load(changed / audit.UPDATES / f"{sha}.npz") as npz:  # an int8 run keeps what the node sent
        enc = {name: npz[name] for name in npz.files}
    np.savez(changed / audit.UPDATES / f"{sha}.npz", q=enc["q"], scale=enc["scale"] * np.float32(1.01))
    assert main(["coordinator", "replay", str(changed)]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH buffer 2: updates/{sha}.npz does not match its SHA-256 (changed)" in out
    assert re.search(r"problem\(s\) in 4 buffers", out)

    changed = shutil.copytree(coord_dir, tmp_path / "schedule")
    lines = (changed / checkpoint.ROUNDS).read_text().splitlines()
    record = json.loads(lines[1])
    held = next(fp for fp, tau in record["staleness"].items() if tau == 1)
    record["staleness"][held] = 0  # claim the held reply was fresh: it would weigh more
    lines[1] = checkpoint.line(record)
    (changed / checkpoint.ROUNDS).write_text("\n".join(lines) + "\n")
    assert main(["coordinator", "replay", str(changed)]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH buffer 2: {held[:12]}'s update is based on model" in out
    assert "MISMATCH buffer 2: recomputed" in out and "model_sha256" in out


class Replayer:
    """A transport whose pulls deliver the replies it is given (``(handle, node, content)``),
    once each, whatever the handle: a node that sends one reply twice."""

    live = False

    def __init__(self, fps: list[str]) -> None:
        self.fps, self.queue = fps, []

    def online(self):
        return {fp: fp for fp in self.fps}

    def strangers(self):
        return []

    def pull(self, handles):
        out, self.queue = [Landed(h, fp, content) for h, fp, content in self.queue], []
        return out


def test_stale_and_replayed_replies_are_rejected_with_their_reason(tmp_path):
    settings = dataclasses.replace(SETTINGS, max_staleness=1, rounds=10, compression="none")
    coord_dir, nodes = make_federation(tmp_path, 4, settings)
    coord = Coordinator(coord_dir)
    a, b, c, d = (fingerprint(n) for n in nodes)
    node = dict(zip((a, b, c, d), nodes))
    transport = Replayer([a, b, c, d])
    loop = Loop(transport, coord, WallClock(settings.deadline))

    def reply(fp, attack=""):
        tasks, w = ask(coord, [fp])
        return coord.ledger.task_of(fp).handle, answer(node[fp], tasks[fp], w, attack)

    def receive(fp, sent):  # the loop pulls the reply to the task ``sent`` answers, then files it
        transport.queue.append((sent[0], fp, sent[1]))
        loop.seen[fp] = fp
        loop.pull()
        return loop.receive(sent[0]) if sent[0] in loop.landed else None

    sent_d = reply(d)  # sent at version 0, answered late
    for _ in range(3):  # a fast node: three replies before the others' first
        assert receive(a, reply(a)) == []
    assert [(fp, valid) for fp, _, valid in loop.buffers.held] == [(a, True), (a, True)]
    first = receive(b, reply(b)) + receive(c, reply(c))
    assert [r["round"] for r in first] == [1] and first[0]["staleness"] == {a: 0, b: 0, c: 0} and first[0]["held"] == [a, a]
    second = receive(b, reply(b)) + receive(c, reply(c))  # with a's second reply (version 0)
    assert second[0]["staleness"] == {a: 1, b: 0, c: 0}
    third = receive(b, reply(b)) + receive(c, reply(c))  # with a's third (version 0): 2 behind
    assert third[0]["rejected"] == {a: "stale: 2 versions behind, max-staleness is 1"}
    assert third[0]["ids"] == sorted([b, c]) and "quorum is 3" in third[0]["skipped"]
    receive(d, sent_d)  # its task carried version 0: too stale when read
    assert loop.buffers.filling[d][0].rejected[d] == "stale: 3 versions behind, max-staleness is 1"
    receive(a, reply(a, "stale-base"))  # signs for a base model it was never sent
    assert loop.buffers.filling[a][0].rejected[a].startswith("trained on base model 000000000000, its task")
    sent = reply(b)
    receive(b, sent)
    held = len(loop.buffers.held)
    assert receive(b, sent) is None  # the same reply again: its task is answered, the reply is dropped unread
    assert len(loop.buffers.held) == held and not len(coord.ledger) and not coord.ledger.pending()
    sent = reply(c)
    coord.engine.flags.quarantined[c] = coord.round  # a quarantined node's reply is not read, its task is gone
    assert receive(c, sent) == [] and c not in loop.buffers.filling and not coord.ledger.busy(c)
    # a restarted coordinator never reuses a task number
    again = Coordinator(coord_dir)
    assert again.round == 3 and again.sent == coord.sent
    assert not len(again.ledger)


def test_a_late_reply_carried_counts_in_the_round_it_arrives_in_and_the_audit_verifies(tmp_path):
    from flwr.supercore.task_identity import TaskIdentity

    settings = dataclasses.replace(SETTINGS, round="sync", late="carry", deadline=3.0, rounds=3, quorum=3)
    coord_dir, nodes = make_federation(tmp_path, 4, settings)
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:  # node 4 answers each task only once the next round's tasks are out
        serve(FakeGrid(nodes, {1: 1, 2: 1, 3: 1, 4: 1}, held=(4,)), Coordinator(coord_dir), poll=0.05)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    first, second, third = records(coord_dir)
    late = fingerprint(nodes[3])
    assert first["asked"] == 4 and first["missing"] == [late] and first["staleness"] == dict.fromkeys(first["ids"], 0)
    assert second["asked"] == 4 and late in second["ids"] and second["staleness"][late] == 1  # not asked, but read
    assert second["updates"][late]["task"] == 1  # its base, round 1's model, is checked by the audit below
    assert third["asked"] == 4 and third["missing"] == [late]  # asked again in round 3, answers in round 4: never
    assert audit.verify(coord_dir) == ([], 3, True)


def test_a_round_whose_every_node_is_carried_waits_for_their_replies_instead_of_failing(tmp_path):
    from flwr.supercore.task_identity import TaskIdentity

    settings = dataclasses.replace(SETTINGS, round="sync", late="carry", deadline=1.0, rounds=2, quorum=3)
    coord_dir, nodes = make_federation(tmp_path, 4, settings)
    grid, coord = FakeGrid(nodes, dict.fromkeys(range(1, 5), 1), held=(1, 2, 3, 4)), Coordinator(coord_dir)
    transport = FlowerTransport(grid, coord, 0.05)
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    loop = Loop(transport, coord, WallClock(coord.settings.deadline))
    try:
        first = loop.play_round(True)  # a slow first round: every node misses it
        assert first["accepted"] == 0 and len(first["missing"]) == 4 and len(coord.ledger) == 4
        grid.release()  # their replies arrive during round 2, which has no node to ask
        second = loop.play_round(False)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    assert second["accepted"] == 4 and set(second["staleness"].values()) == {1} and not second["skipped"]
    assert not len(coord.ledger)


def test_a_deployed_async_run_does_not_wait_for_a_slow_volunteer(tmp_path):
    """node4 answers each task 5 s before its 60 s deadline (``slow-drip``: a deterministic slow
    node; ``--slow`` waits a random time): three fast nodes fill the buffers meanwhile. Every
    update is recomputed by the coordinator; node1 runs at another CPU level, so each of its
    checks whose bits differ (int8 codes may come out the same) is disputed (dispute-share) in
    the middle of the buffers, over Flower, and cleared."""
    from .test_federation_deploy import join, robust, wait_until

    port = launch.free_port()
    settings = dataclasses.replace(SETTINGS, rounds=2, deadline=60.0, port=port, spot_check=1.0, verifier="self",
                                   dispute_share=1.0)
    coord, nodes = make_federation(tmp_path, 4, settings)
    procs = [robust("coordinator", "start", str(coord), log=tmp_path / "coordinator.log")]
    try:  # volunteers keep trying until the coordinator is up
        procs.extend(join(node, coord, port, *{1: ["--profile", "cpu:isa=default"], 4: ["--attack", "slow-drip"]}
                          .get(i, [])) for i, node in enumerate(nodes, 1))
        logs = [tmp_path / "coordinator.log", coord / "logs" / "superlink.log", *(n / "join.log" for n in nodes)]
        wait_until(lambda: (coord / checkpoint.RESULT).exists(), 240, "the run to finish", logs)
        assert procs[0].wait(30) == 0
    finally:  # all at once: each volunteer stops its SuperNode first
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda proc: launch.stop(proc, grace=5), procs))
    log = records(coord)
    slow, fast = fingerprint(nodes[3]), [fingerprint(n) for n in nodes[:3]]
    assert [r["round"] for r in log] == [1, 2] and all(len(set(r["ids"])) == 3 for r in log)
    count = {fp: sum(fp in r["ids"] for r in log) for fp in [*fast, slow]}
    assert count[slow] == 0 and all(count[fp] == 2 for fp in fast), count  # the fast nodes filled the buffers
    assert max(log[1]["staleness"].values()) <= 1
    assert "2 asynchronous buffers of 3 replies" in (tmp_path / "coordinator.log").read_text()
    assert audit.replay_main(str(coord)) == 0
    disputed = [d for r in log for v in r["spot"] for d in v.get("disputes", [])]
    assert {d["node"] for d in disputed} == {fast[0]} and not any(d["guilty"] for d in disputed)
    # each check of node1 was disputed, or its int8 codes came out the same on both levels
    assert all(v.get("disputes") or v["distance"] == 0.0 for r in log for v in r["spot"] if v["author"] == fast[0])
    assert all(not r["convicted"] for r in log) and audit.verify(coord)[0] == []
