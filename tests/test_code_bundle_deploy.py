"""A user's model and data set in a real federation (SuperLink and SuperNodes on loopback): the
coordinator ships the code in its Flower App bundle; a volunteer that accepted the bundle's
SHA-256 trains with it in the bundle's own warm trainer (one for the whole run, giving the bits of
the in-process federation), one that did not never unpacks it and says how to accept it."""

from __future__ import annotations

import sys

from nodes import checkpoint, launch
from nodes.settings import Settings

import json

from nodes.coordinator.coordinator import Coordinator

from .federation_kit import fingerprint, make_federation, play
from .test_federation_deploy import join, procs, robust, rounds_done, wait_until  # noqa: F401 - procs is a fixture
from .test_user_code import EXAMPLE


def test_volunteers_run_shipped_code_only_once_they_trust_its_hash(tmp_path, procs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sys, "path", list(sys.path))
    port = launch.free_port()
    settings = Settings(rounds=2, model="mymodel:make", dataset="mydata:load", code=str(EXAMPLE), aggregator="median",
                        tolerate=0, quorum=2, deadline=45.0, protocol="delta:steps=3", port=port)
    coord, nodes = make_federation(tmp_path, 3, settings)
    sha = (coord / launch.CODE_SHA).read_text().strip()
    procs.append(robust("coordinator", "start", str(coord), log=tmp_path / "coordinator.log"))
    logs = [tmp_path / "coordinator.log", *(n / "join.log" for n in nodes)]
    wait_until(lambda: "submitted" in (tmp_path / "coordinator.log").read_text(), 120, "the run's submission", logs)
    assert f"code bundle {sha}" in (tmp_path / "coordinator.log").read_text()
    for i, node in enumerate(nodes, start=1):
        trust = ["--trust-code", sha] if i < 3 else []
        procs.append(join(node, coord, port, "--data", "mydata:load", "--path", str(EXAMPLE), *trust))
    wait_until(lambda: (coord / checkpoint.RESULT).exists(), 240, "the run to finish", logs)
    records = rounds_done(coord)
    distrustful = fingerprint(nodes[2])
    assert [r["accepted"] for r in records] == [2, 2]
    for record in records:
        assert "has not accepted the code bundle" in record["failed"][distrustful]
    assert records[-1]["accuracy"] > 0.4  # 4 classes; the trusting nodes trained the shipped CNN
    said = (nodes[2] / "join.log").read_text()
    assert f"bundle {sha}" in said and f"--trust-code {sha}" in said and "mymodel.py" in said
    assert not (nodes[2] / "flwr-home" / "apps").exists() or not any((nodes[2] / "flwr-home" / "apps").iterdir())
    for node in nodes[:2]:  # warm: one trainer of the bundle answered both rounds
        assert (node / "join.log").read_text().count(f"code bundle {sha[:12]}: its trainer listens") == 1
    reference, others = make_federation(tmp_path / "reference", 3, settings)
    coordinator = Coordinator(reference)
    while not coordinator.done:
        play(coordinator, others, {3: "decline"})
    assert json.loads((coord / checkpoint.RESULT).read_text())["model_sha256"] == \
        json.loads((reference / checkpoint.RESULT).read_text())["model_sha256"]
