"""A small ``robust stress``: real coordinator and volunteer processes, protocol faults and a
volunteer SIGKILLed every round; no reply lost, no crash (the full figures are in the README)."""

from __future__ import annotations

import argparse
import json

from evaluation.field.stress import Stress, reason_kind
from nodes.coordinator import audit
from nodes.coordinator.coordinator import COSTS


def test_reason_kinds_group_replies_rejected_for_the_same_cause():
    assert reason_kind("malformed reply: update is 38608 bytes, a model of 4810 float32 values takes at most 20264") \
        == reason_kind("malformed reply: update is 99 bytes, a model of 7 float32 values takes at most 1052")
    assert reason_kind("signed for round 3, this is round 4 (a replay?)") == "signed for round #, this is round # (a replay?)"
    assert reason_kind("malformed reply: update bytes hold float64, labelled float32: expected float32") \
        == "update bytes hold float64, labelled float32: expected float32"


def test_faults_and_kills_lose_no_reply_and_crash_nothing(tmp_path):
    args = argparse.Namespace(nodes=4, rounds=2, faults="dtype-lie,decline", kill=0.25, deadline=30.0, seed=0)
    stress = Stress(args, tmp_path)
    report = stress.run()
    json.dumps(report, allow_nan=False)
    assert report["crashes"] == 0 and report["lost"] == 0
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert all(r["killed"] == 1 for r in report["rounds"])
    rejected = {kind for r in report["rounds"] for kind in r["rejected"]}
    assert rejected <= {"update bytes hold float64, labelled float32: expected float32"}
    assert sum(r["declined"] for r in report["rounds"]) >= 1
    assert not list(stress.coord.glob("*.db"))  # the SuperLink keeps its state in memory


def test_light_nodes_speak_the_whole_protocol_and_lose_no_reply(tmp_path):
    """``robust stress --light``: one process drives every node's authenticated session to a
    real coordinator; one node killed each round; the run's log verifies like any other."""
    args = argparse.Namespace(nodes=6, rounds=2, light=True, attack="alie", kill=0.2, deadline=10.0, seed=0)
    stress = Stress(args, tmp_path)
    report = stress.run()
    json.dumps(report, allow_nan=False)
    assert report["light"] and report["crashes"] == 0 and report["lost"] == 0 and report["lost_causes"] == {}
    assert [r["killed"] for r in report["rounds"]] == [1, 1]
    assert all(r["accepted"] >= 4 and r["received"] == r["accepted"] for r in report["rounds"])
    assert all(tuple(r["costs"]) == COSTS and min(r["costs"].values()) >= 0 for r in report["rounds"])
    assert all(r["costs"]["send"] > 0 and r["costs"]["hashing"] > 0 and r["costs"]["rule"] > 0 for r in report["rounds"])
    assert report["superlink_peak_mb"] > 0 and report["coordinator_peak_mb"] > 0 and report["replies_per_s"] > 0
    problems, rounds, replayed = audit.verify(stress.coord)
    assert problems == [] and rounds == 2 and replayed
