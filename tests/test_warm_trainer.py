"""The volunteer's warm trainer, a real process, asked by the thin ClientApp's own function
(:func:`nodes.volunteer.thin_app.relay`): the same reply as the in-process ClientApp, and a
clean decline, saying why, when the trainer is absent, dies, hangs or answers garbage; in a
real federation (``robust node join``), the round goes on and the volunteer's fresh trainer
answers the next, and each volunteer's terminal says, in a line per task, what it did (Flower's
own log kept in a file of its folder). (That ``robust demo``, whose volunteers run warm trainers,
ends with the bits of its federation played in-process is checked on the demo that
``tests/test_dashboard.py`` runs: one demo, a minute of real processes, serves both.)"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nodes import checkpoint, codetrust, launch
from nodes.coordinator.coordinator import Coordinator
from nodes.settings import Settings
from nodes.volunteer import bundles, channel, worklog
from nodes.volunteer.client_app import Node, answer
from nodes.volunteer.thin_app import MARGIN, budget, relay
from nodes.volunteer.terminal import FLOWER_LOG, task_line
from nodes.wire import Task, content_bytes, read_reply, reply_payload, task_content
from robust import codecs, keys
from robust.params import sha256

from .federation_kit import fingerprint, make_federation
from .test_federation_deploy import join, procs, robust, rounds_done, wait_until  # noqa: F401 - procs is a fixture

SETTINGS = Settings(rounds=2, aggregator="median", tolerate=0, quorum=1, protocol="delta:steps=4", compression="int8",
                    deadline=60.0)


def start(node: Path, attack: str = "", parts: int = 2, wrap: list[str] = ()) -> subprocess.Popen:
    """The node's trainer (its part of ``parts``; its command prefixed by ``wrap``, a compute
    profile's), set up as ``robust node join`` sets it up; returns once it listens."""
    proc = launch.start_trainer(node, node / "trainer.log", setup={
        "device": "cpu", "dataset": "digits", "root": None, "part": f"{node.name.removeprefix('node')}/{parts}",
        "attack": attack, "slow": 0.0, "code": ""}, wrap=wrap)
    until = time.monotonic() + 300
    while time.monotonic() < until and proc.poll() is None:
        try:
            channel.connect(node, time.monotonic()).close()
            return proc
        except channel.Absent:
            time.sleep(0.3)
    launch.stop(proc)
    raise AssertionError(f"the trainer did not start: {(node / 'trainer.log').read_text()[-2000:]}")


@pytest.fixture
def federation(tmp_path):
    coord, nodes = make_federation(tmp_path, 2, SETTINGS)
    return Coordinator(coord), nodes


def a_task(coord: Coordinator, node: Path, check: tuple[str, str] | None = None, deadline: float | None = None):
    tasks, w = coord.tasks([fingerprint(node)])
    task = tasks[fingerprint(node)]
    return task_content(task if deadline is None else dataclasses.replace(task, deadline=deadline), w, check)


def test_the_thin_client_app_loads_no_torch_and_node_join_no_flower():
    for module, heavy in (("thin_app", "'torch', 'nodes.volunteer.volunteer'"), ("join", "'torch', 'flwr'")):
        done = subprocess.run([sys.executable, "-c", f"import sys, nodes.volunteer.{module}; "
                               f"print(sorted(m for m in ({heavy}) if m in sys.modules))"],
                              capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "[]", module


def test_the_warm_trainer_replies_as_the_in_process_client_app(federation):
    coord, nodes = federation
    node = nodes[0]
    proc = start(node)
    try:
        assert (node / channel.DIR).stat().st_mode & 0o777 == 0o700  # no other user may reach the trainer
        assert channel.socket_path(node).stat().st_mode & 0o777 == 0o600
        d, codec = coord.engine.w.numel(), codecs.build(SETTINGS.compression)
        public = keys.load_private(node).public_key()
        sizes = []  # of each reply's arrays, as they travel
        for check in (None, (fingerprint(nodes[1]), "2/2")):  # its own work, then a spot check of node2
            content = a_task(coord, node, check)
            replies = relay(node, content, time.time(), 90.0), answer(Node.load(node), content, time.time())
            sizes += map(content_bytes, replies)
            warm, cold = (read_reply(r, d, codec) for r in replies)
            assert not warm[0].refused
            assert dataclasses.replace(warm[0], signature=b"", seconds=0.0) == dataclasses.replace(cold[0], signature=b"", seconds=0.0)
            assert torch.equal(torch.from_numpy(warm[1].copy()), torch.from_numpy(cold[1].copy()))
            assert all((warm[2][k] == cold[2][k]).all() for k in cold[2])
            assert keys.verify(public, warm[0].signature, reply_payload(warm[0], sha256(torch.from_numpy(warm[1].copy()))))
        work = [json.loads(line) for line in (node / worklog.WORK_LOG).read_text().splitlines()]
        assert [(w["kind"], w["steps"], w["declined"]) for w in work] == [("training", 4, False)] * 2 + [("check", 4, False)] * 2
        assert [w["bytes"] for w in work] == sizes
        assert task_line(work[2]).startswith(f"round {work[2]['round']} spot check: 4 local steps in ")
        assert task_line(work[2]).endswith(f" s, {work[2]['bytes']:,} B up, sent")
    finally:
        launch.stop(proc)



def test_a_code_bundle_trainer_starts_once_and_only_for_the_bundle_the_volunteer_accepted(federation, tmp_path):
    """The node's trainer starts a bundle's trainer as its child (the end-to-end run on a
    shipped model is ``tests/test_code_bundle_deploy.py``): refused, saying why, for a bundle
    the volunteer did not accept; started once for one it did; gone with the node's trainer."""
    _, nodes = federation
    node, code = nodes[0], tmp_path / "bundle"
    code.mkdir()
    (code / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    sha = codetrust.folder_sha256(code)
    proc = start(node)
    try:
        with pytest.raises(RuntimeError, match=f"code bundle {sha[:12]} could not start: it exited \\(2\\): "
                                               "error: this volunteer has not accepted the code bundle"):
            bundles.ensure(node, sha, str(code), time.monotonic() + 60)
        codetrust.trust(node, sha)
        bundles.ensure(node, sha, str(code), time.monotonic() + 60)
        pid = channel.peer_pid(channel.connect(node, time.monotonic(), sha))
        bundles.ensure(node, sha, str(code), time.monotonic() + 60)  # it listens: nothing started
        assert channel.peer_pid(channel.connect(node, time.monotonic(), sha)) == pid != proc.pid
        assert list(bundle_trainers(node, sha)) == [pid]  # found as it runs
        assert (channel.socket_path(node, sha).parent.stat().st_mode & 0o777) == 0o700
    finally:
        launch.stop(proc)
    until = time.monotonic() + 30  # the signal reaches it with its parent's; its exit takes a moment
    while bundle_trainers(node, sha) and time.monotonic() < until:
        time.sleep(0.1)
    assert not bundle_trainers(node, sha), bundle_trainers(node, sha)  # it died with the node's trainer


def bundle_trainers(node: Path, sha: str) -> dict[int, str]:
    """The live processes (zombies aside) running the trainer of bundle ``sha`` for ``node``:
    pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if "--bundle" in command and sha in command and str(node) in command and state != "Z":
            found[int(entry.name)] = command
    return found


def test_the_trainer_has_until_the_deadline_or_the_ttl_when_a_late_answer_counts():
    def task(**change) -> Task:
        return Task.of(Settings(deadline=20.0, **change), "run", 1, "0" * 64)

    assert budget(task(), 100.0, 50.0, 102.0) == 20.0 - MARGIN - 2.0  # sent 2 s ago
    assert budget(task(late="carry"), 100.0, 50.0, 102.0) == budget(task(round="async"), 100.0, 50.0, 102.0) == 50.0 - MARGIN - 2.0
    assert budget(task(), 100.0, 50.0, 40.0) == budget(task(), 100.0, 50.0, 1000.0) == 20.0 - MARGIN  # clocks disagree
    assert budget(task(), 100.0, 50.0, 119.0) == 1.0

def test_no_trainer_is_a_decline_that_says_what_to_do(federation):
    coord, nodes = federation
    (nodes[0] / channel.DIR).mkdir(mode=0o700)
    (nodes[0] / channel.DIR / channel.SOCKET).touch()  # a dead trainer's socket
    reply = read_reply(relay(nodes[0], a_task(coord, nodes[0], deadline=4.0), time.time(), 34.0), 1, None)[0]
    assert reply.refused.startswith("this node's trainer is not running") and "robust node join" in reply.refused
    assert json.loads((nodes[0] / worklog.WORK_LOG).read_text())["declined"] is True


def test_node_join_reads_whole_lines_of_the_work_log_and_passes_over_a_broken_one(tmp_path):
    (tmp_path / worklog.WORK_LOG).write_bytes(b'{"round": 1}\n{"round": 2, "cut short\n{"round": 3}\n{"round": 4')
    lines, offset = worklog.since(tmp_path, 0)
    assert lines == [{"round": 1}, {"round": 3}] and worklog.since(tmp_path, offset) == ([], offset)
    with open(tmp_path / worklog.WORK_LOG, "ab") as log:
        log.write(b"}\n")  # the line being written is done
    assert worklog.since(tmp_path, offset)[0] == [{"round": 4}]


@pytest.mark.parametrize(("fault", "said"), [("trainer-crash", "died while answering"),
                                             ("trainer-hang", "did not answer in time"),
                                             ("trainer-garbage", "answered garbage")])
def test_a_trainer_that_dies_hangs_or_garbles_declines_the_task_and_is_gone(federation, fault, said):
    coord, nodes = federation
    proc = start(nodes[0], fault)
    try:
        started = time.monotonic()
        reply = read_reply(relay(nodes[0], a_task(coord, nodes[0], deadline=8.0), time.time(), 38.0), 1, None)[0]
        assert reply.refused.startswith(f"this node's trainer {said}")
        assert "`robust node join` starts a fresh one" in reply.refused
        assert time.monotonic() - started < 8.0  # within the deadline, less the margin
        assert proc.wait(10) == -9  # killed (by itself, or by the ClientApp that gave up on it)
    finally:
        launch.stop(proc)



SAID = ("died while answering", "did not answer in time", "answered garbage")  # by a crashed, hung, garbling trainer
TASK_LINE = re.compile(r"^\d\d:\d\d:\d\d round (\d+) training: (\d+) local steps? in \d+\.\d\d s, ([\d,]+) B up, "
                       r"(sent|declined: .*?)(?: \(|$)", re.M)  # a decline's reason: its first words


def test_a_round_goes_on_past_trainers_that_die_hang_or_garble_and_their_volunteers_recover(tmp_path, procs):  # noqa: F811
    port = launch.free_port()
    settings = Settings(rounds=2, aggregator="median", tolerate=0, quorum=1, deadline=30.0, protocol="delta:steps=4",
                        port=port)
    coord, nodes = make_federation(tmp_path, 4, settings)
    procs.append(robust("coordinator", "start", str(coord), log=tmp_path / "coordinator.log"))
    logs = [tmp_path / "coordinator.log", *(n / "join.log" for n in nodes)]
    wait_until(lambda: "submitted" in (tmp_path / "coordinator.log").read_text(), 120, "the run's submission", logs)
    faults = {nodes[1]: "trainer-crash", nodes[2]: "trainer-hang", nodes[3]: "trainer-garbage"}
    procs.extend(join(node, coord, port, *(["--attack", faults[node]] if node in faults else [])) for node in nodes)
    wait_until(lambda: (coord / checkpoint.RESULT).exists(), 300, "the run to finish", logs)
    first, second = rounds_done(coord)
    assert first["accepted"] == 1 and not first["rejected"] and not first["missing"]
    for node, said in zip(nodes[1:], SAID):
        assert first["failed"][fingerprint(node)].startswith(f"declined the task: this node's trainer {said}")
        assert "the trainer exited (killed by signal 9): starting a fresh one" in (node / "join.log").read_text()
    assert second["accepted"] == 4 and not second["failed"]  # each volunteer's fresh trainer answered
    # what each volunteer's terminal said: a line per task, from its work log; then that the coordinator left
    wait_until(lambda: all("stopped answering" in (n / "join.log").read_text() for n in nodes), 60,
               "the volunteers to see the coordinator gone", logs)
    for node in nodes:
        said = (node / "join.log").read_text()
        tasks = [m.groups() for m in TASK_LINE.finditer(said)]
        assert [(number, steps) for number, steps, *_ in tasks] == [("1", "0" if node in faults else "4"), ("2", "4")], said
        up = [int(n.replace(",", "")) for _, _, n, _ in tasks]
        assert up == [r["bytes_per_node"][fingerprint(node)[:12]][0] for r in (first, second)]  # the coordinator's count
        assert [outcome for *_, outcome in tasks] == (
            [f"declined: this node's trainer {dict(zip(nodes[1:], SAID))[node]}", "sent"] if node in faults else ["sent"] * 2)
        assert "stopped answering after round 2: its run has finished, or it stopped. Waiting for it" in said
        assert "\x1b" not in said and "Receiving" not in said and "Connection attempt failed" not in said
        flower = (node / FLOWER_LOG).read_text()  # Flower's own lines, as plain text
        assert "Receiving: train message" in flower and "\x1b" not in flower
