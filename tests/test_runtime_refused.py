"""A reply Flower's runtime refuses (``nodes.volunteer.runtime_watch``): real coordinator and
volunteer processes, one volunteer's ClientApp stalled (SIGSTOP, heartbeat thread and all) past
its task's heartbeat window once its trainer answered; the SuperNode has ended the task, its
reply is refused. The volunteer logs it with the cause, and ``robust stress`` counts it lost
with that cause.

Flower's window is 2 x 30 s; so that the test takes seconds, the SuperNode and the ClientApp
processes (and only those: the SuperLink's node heartbeats keep theirs) start with a shorter
one (``HEARTBEAT_DEFAULT_INTERVAL``, ``HEARTBEAT_PATIENCE``, read by Flower at import), through
a ``sitecustomize`` on ``PYTHONPATH``: Flower's own code enforces it."""

from __future__ import annotations

import argparse
import json
import os

from evaluation.field.stress import Stress
from nodes.volunteer.worklog import WORK_LOG

SITE = """\
with open("/proc/self/cmdline", "rb") as _cmdline:
    _argv = _cmdline.read()
if b"flower-supernode" in _argv or b"flwr-clientapp" in _argv:
    from flwr.common import constant

    constant.HEARTBEAT_DEFAULT_INTERVAL = 10  # a task's heartbeat every (10 - 5) x 0.8 = 4 s or so
    constant.HEARTBEAT_PATIENCE = 0.6  # its token lives 6 s past the last one
"""


def test_a_reply_the_runtime_refuses_is_logged_by_the_volunteer_and_counted_lost_with_its_cause(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    # round 1 ends when Flower reports the stalled task (6 s); the rounds after it keep the run
    # going until the stalled process wakes (7 s) and finds its reply refused
    args = argparse.Namespace(nodes=3, rounds=3, faults="clientapp-stall", kill=0.0, deadline=20.0, seed=0)
    stress = Stress(args, tmp_path / "run")
    report = stress.run()
    stalled = stress.volunteers[0]
    work = [json.loads(line) for line in (stalled.folder / WORK_LOG).read_text().splitlines()]
    refused = [entry["refused_by_runtime"] for entry in work if "refused_by_runtime" in entry]
    assert len(refused) == 1 and ("401" in refused[0] or "ended the task" in refused[0]), work  # push, or heartbeat
    assert report["crashes"] == 0 and report["lost"] == 1 and report["lost_causes"] == {refused[0]: 1}
    first, *rest = report["rounds"]
    assert first["asked"] == 3 and first["accepted"] == 2 and first["lost"] == 1
    assert [r["accepted"] for r in rest] == [3, 3]  # the stalled node answers again
    assert "was lost" in (stalled.folder / "join.log").read_text()
