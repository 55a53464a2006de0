"""The coordinator's disputes (``nodes.coordinator.arbitration``) with volunteers' warm trainers in
real processes at another CPU level than the coordinator's (``cpu:isa=default``: PyTorch's
scalar kernels, oneDNN at SSE4.1): an honest volunteer's cross-profile check, disputed, is
cleared on its steps; a consistent forger at 0.999 is convicted on its first step; both
answer over the volunteer's own channel, as ``robust node join``'s ClientApps relay them; the
audit referees every dispute again and finds a changed state."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.bench.cell import CellSetup
from evaluation.bench.drivers import federation
from evaluation.bench.scenario import cells, load_scenario
from nodes import launch
from nodes.coordinator import audit
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.arbitration import Dispute
from nodes.coordinator.verifier import Checkers
from nodes.dashboard.view import RunView
from nodes.engine.inbox import Inbox
from nodes.engine.ledger import CHECK, DISPUTE
from nodes.engine.training import NodeData, part_of
from nodes.settings import Settings
from nodes.volunteer import worklog
from nodes.volunteer.client_app import Node, answer
from nodes.volunteer.thin_app import relay
from nodes.volunteer.trainer import setup
from nodes.volunteer.volunteer import NodeConfig, sign
from nodes.wire import Task, claim_content, claim_payload, read_claim, read_reply, reply_content, task_content
from robust import keys
from robust.params import sha256
from robust.profiles import Profile

from .federation_kit import ask, file, fingerprint, make_federation, withdraw
from .test_warm_trainer import start

SETTINGS = dict(rounds=2, aggregator="median", tolerate=0, quorum=1, model="cnn", protocol="delta:steps=3",
                batch_size=16, spot_check=1.0, verifier="self", dispute_share=1.0)
LEVEL = Profile.parse("cpu:isa=default")


def play(coord: Coordinator, nodes: list[Path], warm: set[Path]) -> dict:
    """One round: the ``warm`` nodes answer through their trainers (tasks and disputes alike),
    the others in-process, as a SuperNode's ClientApp would."""
    by_fp = {fingerprint(n): n for n in nodes}

    def reply(node: Path, content):
        return relay(node, content, time.time(), 120.0) if node in warm else answer(Node.load(node), content, time.time())

    def asks(asked: dict, kind: str) -> dict:
        assert kind == DISPUTE  # verifier = self: the coordinator recomputes every check itself
        return {key: reply(by_fp[fp], content) for key, (fp, content) in asked.items()}

    fps = sorted(by_fp)
    for fp in fps:
        withdraw(coord, fp)
    tasks, w = ask(coord, fps)
    inbox = Inbox()
    for fp in fps:
        file(coord, fp, reply(by_fp[fp], task_content(tasks[fp], w)), inbox)
    return coord.finish_round(fps, inbox, 0.0, Checkers(fps, asks))


def test_cross_level_disputes_clear_the_honest_convict_a_forger_and_replay_in_the_audit(tmp_path):
    if LEVEL.refusal():
        pytest.skip(LEVEL.refusal())
    coord_dir, nodes = make_federation(tmp_path, 3, Settings(**SETTINGS))
    honest, forger = nodes[0], nodes[1]
    setup(nodes[2], "cpu", "digits", None, "3/3", "", 0.0, "")  # answers in-process, at the coordinator's level
    procs = [start(honest, "", 3, LEVEL.prefix()), start(forger, "forge:scale=0.999,consistent=true", 3, LEVEL.prefix())]
    try:
        coord = Coordinator(coord_dir)
        first = play(coord, nodes, {honest, forger})
        second = play(coord, nodes, {honest})
    finally:
        for proc in procs:
            launch.stop(proc)
    spot = {v["author"]: v for v in first["spot"]}
    h, f, same = fingerprint(honest), fingerprint(forger), fingerprint(nodes[2])
    assert first["updates"][h]["profile"] != first["updates"][same]["profile"]  # the levels differ
    # the honest volunteer: other bits, disputed (dispute-share), cleared on every step
    [ruling] = spot[h]["disputes"]
    assert ruling["guilty"] is False and ruling["reason"].startswith("cleared") and ruling["steps_checked"] == 3
    assert spot[h]["guilty"] == [] and h in first["ids"] and spot[h]["distance"] > 0
    # the forger: beyond the whole-update bound, disputed, convicted on its first step, left out
    [ruling] = spot[f]["disputes"]
    assert ruling["guilty"] is True and ruling["step"] == 1 and ruling["reason"].startswith("step 1 is not the task's step")
    assert first["convicted"] == [f] and f not in first["ids"] and spot[f]["distance"] > 1e-4
    assert first["rejected"][f].startswith("convicted in a dispute over its update: step 1 is not the task's step")
    # the in-process volunteer shares the coordinator's profile: checked bit for bit, no dispute
    assert spot[same]["distance"] == 0.0 and "disputes" not in spot[same]
    assert [v["author"] for v in second["spot"] if v.get("disputes")] == [h] and second["convicted"] == []
    board = RunView(coord_dir).docs()  # what the operator's dashboard shows
    assert board["status"]["audit"]["disputes"] == {"opened": 3, "cleared": 2, "convicted": 1}
    [convicted] = [n for n in board["nodes"] if n["convicted"]]
    assert convicted["convicted"]["dispute"].startswith("step 1 is not the task's step")
    assert convicted["why"] == "convicted in a dispute"
    work = [json.loads(line) for line in (honest / worklog.WORK_LOG).read_text().splitlines()]
    assert [w["kind"] for w in work] == ["training", "dispute"] * 2 and work[1]["steps"] == 3
    # the audit referees every dispute again from the kept states; a changed state is found
    assert audit.verify(coord_dir) == ([], 2, True)
    path = audit.row_path(coord_dir, spot[h]["disputes"][0]["sha256"])
    states = np.load(path)
    states[-1] += np.float32(1e-3)
    np.save(path, states)
    problems, _, _ = audit.verify(coord_dir)
    assert problems and problems[0].startswith("round 1: the dispute with") and "does not match its SHA-256" in problems[0]


def test_a_referee_profile_checks_volunteers_at_its_level_bit_for_bit(tmp_path):
    """``referee-profile = cpu:isa=default``: the coordinator's recomputations run in a process at
    that level; a volunteer there is checked bit for bit, one at this machine's best level is
    disputed (dispute-share) and cleared by the same referee; the audit referees it again there."""
    if LEVEL.refusal():
        pytest.skip(LEVEL.refusal())
    coord_dir, nodes = make_federation(tmp_path, 2, Settings(**SETTINGS, referee_profile=LEVEL.spec))
    setup(nodes[1], "cpu", "digits", None, "2/2", "", 0.0, "")
    proc = start(nodes[0], "", 2, LEVEL.prefix())
    try:
        record = play(Coordinator(coord_dir), nodes, {nodes[0]})
    finally:
        launch.stop(proc)
    spot = {v["author"]: v for v in record["spot"]}
    at_level, best = fingerprint(nodes[0]), fingerprint(nodes[1])
    assert spot[at_level]["distance"] == 0.0 and "disputes" not in spot[at_level]
    [ruling] = spot[best]["disputes"]
    assert ruling["referee"] == record["updates"][at_level]["profile"] != record["updates"][best]["profile"]
    assert "/DEFAULT/" in ruling["referee"] and ruling["guilty"] is False and record["convicted"] == []
    assert audit.verify(coord_dir) == ([], 1, True)


def test_a_dispute_answer_is_read_strictly_and_a_bad_one_convicts(tmp_path):
    coord_dir, nodes = make_federation(tmp_path, 2, Settings(**SETTINGS))
    setup(nodes[0], "cpu", "digits", None, "1/2", "", 0.0, "")
    coord = Coordinator(coord_dir)
    tasks, w = coord.tasks([fingerprint(nodes[0])])
    task: Task = tasks[fingerprint(nodes[0])]
    d = coord.engine.w.numel()
    node = Node.load(nodes[0])
    row = torch.zeros(d)
    dispute = Dispute(fingerprint(nodes[0]), fingerprint(nodes[0]), task, torch.from_numpy(w.copy()), "1/2", row,
                      "0" * 64, "another")
    content = answer(node, dispute.content(), time.time())
    reply, hashes, states = read_claim(content, d, 3)
    assert not reply.refused and len(hashes) == 4 and states.shape == (4, 2 * d)
    assert keys.verify(node.key.public_key(), reply.signature, claim_payload(reply, sha256(torch.from_numpy(states.reshape(-1).copy()))))
    for broken, said in ((claim_content(reply, hashes[:-1], states), "are not 4 SHA-256"),
                         (claim_content(reply, hashes, states[:, :-1]), "states")):
        with pytest.raises(ValueError, match=said):
            read_claim(broken, d, 3)


@pytest.mark.parametrize(("profile", "said"), [("cpu:isa=sse", "isa must be one of default, avx2, avx512"),
                                               ("cuda --device cpu", "--profile cuda with --device cpu")])
def test_node_join_refuses_a_profile_it_cannot_run_in_one_line(tmp_path, profile, said):
    done = subprocess.run([sys.executable, "-m", "robust.cli", "node", "join", "--coordinator", "127.0.0.1:1", "--ca",
                           str(tmp_path / "ca.crt"), "--key", str(tmp_path), "--profile", *profile.split()],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_profiles_go_to_the_nodes_in_turn_under_engine_deploy_and_are_refused_elsewhere():
    scenario = load_scenario(None, ['profiles=["cpu:isa=default", "cpu"]', "nodes=5", "byzantine=0"], "deploy")
    setup = CellSetup(cells(scenario)[0])
    assert [setup.profile_of(fp).spec for fp in setup.ids] == ["cpu:isa=default,threads=1", "cpu:threads=1"] * 2 + [
        "cpu:isa=default,threads=1"]
    assert setup.profile_of(setup.ids[0]).prefix() == ["env", "ATEN_CPU_CAPABILITY=default", "DNNL_MAX_CPU_ISA=SSE41"]
    assert setup.profile_of(setup.ids[1]).prefix() == []
    for engine in ("local", "flower"):
        with pytest.raises(ValueError, match="run it with --engine deploy"):
            load_scenario(None, ['profiles=["cpu:isa=default", "cpu"]'], engine)
    with pytest.raises(ValueError, match="referee-profile = 'cpu:isa=default' is the coordinator's"):
        load_scenario(None, ['referee-profile="cpu:isa=default"'], "local")
    with pytest.raises(ValueError, match="isa must be one of"):
        load_scenario(None, ['profiles=["cpu:isa=sse"]'], "deploy")


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_a_bench_node_declares_the_part_it_holds_so_a_check_recomputes_from_it(tmp_path, partition):
    scenario = load_scenario(None, [f'partition="{partition}"', "alpha=0.3", "nodes=4", "byzantine=0", "seeds=[3]"],
                             "deploy")
    setup = CellSetup(cells(scenario)[0])
    _, folders = federation.build(setup, tmp_path, port=9)
    data = setup.data
    for folder, fp in zip(folders, setup.by_index):
        config = NodeConfig.load(folder)
        held, rebuilt = NodeData.load(Path(config.data)), part_of(data, config.part)
        assert config.part.startswith(f"{folders.index(folder) + 1}/4;{partition}:") and config.part.endswith("seed=3")
        assert torch.equal(held.x, rebuilt.x) and torch.equal(held.y, rebuilt.y)


def test_a_false_accuser_on_another_profile_is_disputed_and_convicted(tmp_path):
    """A verifier that declares another profile and signs a scaled check: the coordinator's
    recomputation clears the author and disagrees with the verifier across profiles, so the
    verifier is disputed: it answers with honest states, whose last does not give the row it
    signed, and is convicted on that."""
    coord_dir, nodes = make_federation(tmp_path, 3, Settings(**(SETTINGS | {"verifier": "nodes", "dispute_share": 0.0,
                                                                            "rounds": 1})))
    for i, node in enumerate(nodes, start=1):
        setup(node, "cpu", "digits", None, f"{i}/3", "", 0.0, "")
    coord = Coordinator(coord_dir)
    by_fp, liar = {fingerprint(n): n for n in nodes}, fingerprint(nodes[0])

    def asks(asked: dict, kind: str = CHECK) -> dict:
        out = {}
        for key, (fp, content) in asked.items():
            answered = answer(Node.load(by_fp[fp]), content, time.time())
            if kind == CHECK and fp == liar:  # a false accusation, signed, declared from another CPU level
                reply, row, _ = read_reply(answered, coord.engine.w.numel())
                row = row * np.float32(1.5)
                reply = dataclasses.replace(reply, profile="cpu/another-level/" + reply.profile)
                reply = sign(reply, Node.load(by_fp[fp]).key, sha256(torch.from_numpy(row)))
                answered = reply_content(reply, row)
            out[key] = answered
        return out

    fps = sorted(by_fp)
    tasks, w = ask(coord, fps)
    inbox = Inbox()
    for fp in fps:
        file(coord, fp, answer(Node.load(by_fp[fp]), task_content(tasks[fp], w), time.time()), inbox)
    record = coord.finish_round(fps, inbox, 0.0, Checkers(fps, asks))
    [accused] = [v for v in record["spot"] if v["verifier"] == liar]
    [ruling] = accused["disputes"]
    assert ruling["node"] == liar and ruling["guilty"] is True
    assert ruling["reason"] == "its last state does not give the row it signed"
    assert record["convicted"] == [liar] and accused["author"] in record["ids"] and accused["guilty"] == [liar]
    assert audit.verify(coord_dir)[0] == []
