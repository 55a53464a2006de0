"""What the coordinator leaves in Flower (issue 23): the model built once for all of a round's
tasks, the replies of withdrawn tasks pulled so the SuperLink frees them, and the window
(``in-flight``) that caps the tasks out at once. In-process on a grid that answers with the
real volunteer's work (``tests.test_async_deploy.FakeGrid``), and one loopback federation."""

from __future__ import annotations

import dataclasses
import itertools
import json
import tracemalloc
from contextlib import contextmanager

import pytest
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

from evaluation.field.large_model_memory import CODE as LARGE
from nodes import checkpoint, launch
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.server_app import FlowerTransport, serve
from nodes.engine.serve import Loop
from nodes.engine.clocks import WallClock
from nodes.settings import Settings
from nodes.volunteer.worklog import WORK_LOG

from .federation_kit import fingerprint, make_federation, reference_sha256
from .test_async_deploy import SETTINGS, FakeGrid, records
from .test_federation_deploy import deploy, procs, rounds_done  # noqa: F401 - procs: a fixture

pytestmark = pytest.mark.filterwarnings("ignore:Field flwr.proto.Array.shape:DeprecationWarning")


@contextmanager
def task_identity():
    """A ServerApp's messages name their run: set it as Flower's ServerApp process would."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class DeflatingGrid:
    """What Flower's ``HttpGrid.push_messages`` does in the ServerApp before anything leaves it:
    every object of every message deflated (its id is the hash of those bytes), each once."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)

    def push_messages(self, messages) -> list[str]:
        with no_object_id_recompute():
            objects = {}
            for message in messages:
                objects.update(get_all_nested_objects(message))
            for obj in objects.values():
                obj.deflate()
        return [str(next(self.ids)) for _ in messages]


def traced_peak(work) -> int:
    """Bytes ``work()`` allocated at its peak (Python's allocations: numpy's and Flower's)."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_serverapp_builds_a_rounds_model_once_whatever_the_number_of_tasks(tmp_path):
    settings = Settings(rounds=2, aggregator="mean", tolerate=0, model="bignet:make", code=str(LARGE))
    coord_dir, nodes = make_federation(tmp_path, 8, settings)
    coord = Coordinator(coord_dir)
    model = 4 * coord.engine.w.numel()
    loop = Loop(FlowerTransport(DeflatingGrid(), coord, 0.0), coord, WallClock(settings.deadline))
    fps = sorted(fingerprint(n) for n in nodes)
    node_of = {fp: i for i, fp in enumerate(fps, start=1)}
    with task_identity():
        first = traced_peak(lambda: loop.send(fps[:7], node_of))  # was one serialized model per task
        later = traced_peak(lambda: loop.send(fps[7:], node_of))  # a later wave of the same round
    assert model > 40e6 and first < 2 * model and later < model / 2, (model, first, later)  # chunks of 5 MB
    assert coord.ledger.in_flight() == len(coord.ledger) == 8


def test_the_reply_to_a_withdrawn_task_is_pulled_so_flower_frees_it(tmp_path):
    """late = drop: node 4 misses round 1, its task is cancelled; its reply, once in, is pulled
    (the SuperLink keeps a reply until it is pulled) and not read."""
    settings = dataclasses.replace(SETTINGS, round="sync", deadline=1.0, rounds=2, quorum=3)
    coord_dir, nodes = make_federation(tmp_path, 4, settings)
    grid, coord = FakeGrid(nodes, dict.fromkeys(range(1, 5), 1), held=(4,)), Coordinator(coord_dir)
    loop = Loop(FlowerTransport(grid, coord, 0.05), coord, WallClock(settings.deadline))
    with task_identity():
        first = loop.play_round(True)
        withdrawn = next(h for h, (_, nid, _) in grid.pending.items() if nid == 4)
        assert first["missing"] == [fingerprint(nodes[3])] and withdrawn in coord.ledger.pending() and not len(coord.ledger)
        grid.release()  # its reply comes in during round 2
        second = loop.play_round(False)
    assert withdrawn not in grid.pending and withdrawn not in coord.ledger.pending()  # pulled, dropped
    assert second["accepted"] == 3 and second["missing"] == [fingerprint(nodes[3])]  # its round-1 reply unread


class PullCountingGrid(FakeGrid):
    """A :class:`FakeGrid` that counts the most replies one pull brought."""

    most = 0

    def pull_messages(self, ids):
        out = super().pull_messages(ids)
        self.most = max(self.most, len(out))
        return out


def test_big_replies_are_pulled_one_at_a_time_with_the_bits_of_pulling_them_all(tmp_path, monkeypatch):
    """Rows bigger than ``PULL_BYTES`` come into the ServerApp one per pull (each filed before
    the next is pulled: the others wait in the SuperLink); the run is bit for bit the run that
    pulled every reply that had come in at once."""
    import nodes.coordinator.server_app as server_app

    settings = dataclasses.replace(SETTINGS, round="sync", rounds=2, quorum=4)
    shas, most = [], []
    for pull_bytes in (server_app.PULL_BYTES, 1):
        monkeypatch.setattr(server_app, "PULL_BYTES", pull_bytes)
        coord_dir, nodes = make_federation(tmp_path / str(pull_bytes), 4, settings)
        grid = PullCountingGrid(nodes, dict.fromkeys(range(1, 5), 1))
        with task_identity():
            serve(grid, Coordinator(coord_dir), poll=0.0)
        shas.append(json.loads((coord_dir / checkpoint.RESULT).read_text())["model_sha256"])
        most.append(grid.most)
    assert most == [4, 1] and shas[0] == shas[1]


class CountingGrid(FakeGrid):
    """A :class:`FakeGrid` that counts the most tasks out at once (pushed, reply not yet pulled)."""

    most = 0

    def push_messages(self, messages) -> list[str]:
        out = super().push_messages(messages)
        self.most = max(self.most, len(self.pending))
        return out


def test_async_rounds_keep_at_most_in_flight_tasks_out_and_starve_no_node(tmp_path):
    settings = dataclasses.replace(SETTINGS, rounds=4, in_flight=2)
    coord_dir, nodes = make_federation(tmp_path, 5, settings)
    grid = CountingGrid(nodes, {1: 1, 2: 2, 3: 2, 4: 2, 5: 1})
    with task_identity():
        serve(grid, Coordinator(coord_dir), poll=0.0)
    log = records(coord_dir)
    assert grid.most == 2 and len(log) == 4 and all(len(set(r["ids"])) == 3 for r in log)
    assert {fp for r in log for fp in r["ids"]} == {fingerprint(n) for n in nodes}  # every node served


def test_a_window_of_one_sends_a_round_task_by_task_with_the_bits_of_no_window(tmp_path, procs):
    """in-flight = 1 on loopback: each task leaves only once the previous reply is in (the
    volunteers' work logs), every round still reads all 3 replies, and the model is the
    in-process reference's (every task at once, every reply in order) bit for bit."""
    port = launch.free_port()
    settings = Settings(rounds=2, aggregator="trimmed-mean", tolerate=1, quorum=3, deadline=60.0, port=port,
                        in_flight=1)
    coord, nodes = make_federation(tmp_path / "deployed", 3, settings)
    deploy(tmp_path, coord, nodes, port, procs)
    assert [r["accepted"] for r in rounds_done(coord)] == [3, 3]
    work = sorted((json.loads(line) for n in nodes for line in (n / WORK_LOG).read_text().splitlines()),
                  key=lambda w: w["task_made"])
    assert len(work) == 6 and all(b["task_made"] > a["time"] for a, b in zip(work, work[1:])), work
    deployed = json.loads((coord / checkpoint.RESULT).read_text())
    assert deployed["model_sha256"] == reference_sha256(tmp_path / "reference", 3, settings)
