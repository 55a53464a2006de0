"""The federation for real: SuperLink and SuperNodes as processes on loopback, over TLS with
node authentication (no mock of Flower). Each round takes several seconds (Flower polls every
3 s and starts a fresh process per task), so these tests are few and short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evaluation.field.stress import kill
from nodes import checkpoint, commands, launch
from nodes.coordinator import audit
from nodes.settings import Settings
from nodes.volunteer import volunteer

from .federation_kit import fingerprint, make_federation, reference_sha256


def robust(*args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    return subprocess.Popen([sys.executable, "-m", "robust.cli", *args], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def join(node: Path, coord: Path, port: int, *extra: str) -> subprocess.Popen:
    return robust("node", "join", "--coordinator", f"127.0.0.1:{port}", "--ca", str(coord / "tls" / "ca.crt"),
                  "--key", str(node), "--partition", next(node.glob("data-*.pt")).stem.split("-")[-1].replace("of", "/"),
                  "--device", "cpu", *extra, log=node / "join.log")


def rounds_done(coord: Path) -> list[dict]:
    path = coord / checkpoint.ROUNDS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(predicate, timeout: float, what: str, logs: list[Path]) -> None:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if predicate():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]) for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def deploy(tmp_path: Path, coord: Path, nodes: list[Path], port: int, procs: list, timeout: float = 300,
           join_args: tuple[str, ...] = ()) -> list[Path]:
    """Start the coordinator of ``coord`` and, once its run is submitted, a volunteer for each
    of ``nodes`` (``node join`` with ``join_args`` too); wait for the run to finish and the
    coordinator to exit cleanly. The logs."""
    procs.append(robust("coordinator", "start", str(coord), log=tmp_path / "coordinator.log"))
    logs = [tmp_path / "coordinator.log", coord / "logs" / "superlink.log", *(n / "join.log" for n in nodes)]
    wait_until(lambda: "submitted" in (tmp_path / "coordinator.log").read_text(), 120, "the run", logs)
    procs.extend(join(node, coord, port, *join_args) for node in nodes)
    wait_until(lambda: (coord / checkpoint.RESULT).exists(), timeout, "the run to finish", logs)
    assert procs[0].wait(30) == 0
    return logs


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        launch.stop(proc, grace=5)


def test_tls_auth_bad_replies_and_a_node_killed_mid_round(tmp_path, procs):
    port = launch.free_port()
    # a round waits out its deadline for the killed node (twice: in round 2, and in round 3 should its
    # reply to round 2 have left before the kill); live nodes answer in seconds (under 20 on a busy machine)
    # every update recomputed by the coordinator; node1 at another CPU level (its bits differ), each
    # of its checks disputed over Flower (dispute-share) and cleared on its steps
    settings = Settings(rounds=3, aggregator="median", tolerate=0, quorum=1, deadline=30.0, port=port,
                        spot_check=1.0, verifier="self", dispute_share=1.0)
    coord, nodes = make_federation(tmp_path, 3, settings)
    stranger = tmp_path / "stranger"
    commands.node_keygen(stranger, seed="not admitted")
    volunteer.prepare_data(stranger, "digits", None, "1/3")
    procs.append(robust("coordinator", "start", str(coord), log=tmp_path / "coordinator.log"))
    logs = [tmp_path / "coordinator.log", coord / "logs" / "superlink.log", *(n / "join.log" for n in nodes)]
    wait_until(lambda: (coord / "logs" / "superlink.log").exists() and "submitted" in (tmp_path / "coordinator.log").read_text(),
               120, "the coordinator to submit its run", logs)
    for i, node in enumerate(nodes, start=1):
        procs.append(join(node, coord, port, *{1: ["--profile", "cpu:isa=default"], 3: ["--attack", "bad-signature"]}
                          .get(i, [])))
    refused = join(stranger, coord, port)
    procs.append(refused)
    wait_until(lambda: len(rounds_done(coord)) >= 1, 180, "round 1", logs)
    wait_until(lambda: "refused this node" in (stranger / "join.log").read_text(), 60, "the stranger's refusal",
               [stranger / "join.log"])  # it keeps trying for nodes.volunteer.join.REFUSAL_GRACE seconds, then exits
    assert "not admitted" in (stranger / "join.log").read_text()
    kill(procs[2])  # node2's volunteer, during round 2
    wait_until(lambda: (coord / checkpoint.RESULT).exists(), 240, "the run to finish", logs)
    assert procs[0].wait(30) == 0
    records = rounds_done(coord)
    names = [fingerprint(n) for n in nodes]
    assert [r["round"] for r in records] == [1, 2, 3]
    assert records[0]["accepted"] == 2 and records[0]["rejected"] == {names[2]: "bad signature"}
    assert names[1] in records[1]["missing"] + records[2]["missing"]  # killed: no reply, round still done
    assert all(not r["skipped"] for r in records)
    disputed = [d for r in records for v in r["spot"] for d in v.get("disputes", [])]
    assert {d["node"] for d in disputed} == {names[0]} and not any(d["guilty"] for d in disputed)
    assert all(v.get("disputes") or v["distance"] == 0.0 for r in records for v in r["spot"] if v["author"] == names[0])
    assert all(r["convicted"] == [] for r in records) and audit.verify(coord)[0] == []
    result = json.loads((coord / checkpoint.RESULT).read_text())
    assert result["rounds"] == 3 and result["rejected"] == {names[2][:12]: "bad signature"}
    assert result["final_accuracy"] > 0.8


def test_killed_coordinator_resumes_and_slow_nodes_give_the_same_bits(tmp_path, procs):
    port = launch.free_port()
    settings = Settings(rounds=3, aggregator="trimmed-mean", tolerate=1, quorum=3, deadline=90.0, port=port,
                        protocol="momentum",  # volunteers keep their momentum in their folders across the kill
                        compression="int8",  # encodings cross real Flower messages
                        bind="0.0.0.0")  # as for volunteers on other machines
    coord, nodes = make_federation(tmp_path / "deployed", 3, settings)
    start = lambda: robust("coordinator", "start", str(coord), log=tmp_path / "coordinator.log")  # noqa: E731
    procs.append(start())
    logs = [tmp_path / "coordinator.log", coord / "logs" / "superlink.log", *(n / "join.log" for n in nodes)]
    wait_until(lambda: "submitted" in (tmp_path / "coordinator.log").read_text(), 120, "the run", logs)
    procs.extend(join(node, coord, port, "--slow", "2") for node in nodes)  # replies in random order
    wait_until(lambda: len(rounds_done(coord)) >= 1, 240, "round 1", logs)
    kill(procs[0])  # during round 2: it resumes after round 1 and plays rounds 2 and 3
    procs[0] = start()
    wait_until(lambda: (coord / checkpoint.RESULT).exists(), 300, "the resumed run to finish", logs)
    assert "resuming after round" in (tmp_path / "coordinator.log").read_text()
    # the reference: the same federation in-process, uninterrupted, every reply in order
    deployed = json.loads((coord / checkpoint.RESULT).read_text())
    assert deployed["model_sha256"] == reference_sha256(tmp_path / "reference", 3, settings)
    assert [r["round"] for r in rounds_done(coord)][-1] == 3
    assert all(3.5 < r["bytes_down"] / r["bytes_up"] < 4 for r in rounds_done(coord) if r["bytes_up"])


def test_a_shared_support_crosses_real_flower_messages_and_the_audit_replays_it(tmp_path, procs, capsys):
    """``shared-sign``: each task announces its coordinates (from the run seed and the task's
    number), the volunteers encode on them with their error feedback, the coordinator checks
    each reply's claim and decodes; the deployed bits are the in-process federation's, and the
    stored encodings (8-byte claims included) replay and verify with no task at hand."""
    port = launch.free_port()
    settings = Settings(rounds=2, aggregator="trimmed-mean", tolerate=0, quorum=2, deadline=60.0, port=port,
                        compression="shared-sign")
    coord, nodes = make_federation(tmp_path / "deployed", 2, settings)
    deploy(tmp_path, coord, nodes, port, procs)
    records = rounds_done(coord)
    assert [(r["accepted"], r["rejected"]) for r in records] == [(2, {}), (2, {})]
    # a reply against a task carrying the float32 model: 33x here, where a reply's signature, hashes and
    # fields (about 380 bytes) outweigh its update (199 bytes for digits' 4,810 parameters)
    assert all(r["bytes_down"] / r["bytes_up"] > 30 for r in records), [(r["bytes_down"], r["bytes_up"]) for r in records]
    deployed = json.loads((coord / checkpoint.RESULT).read_text())["model_sha256"]
    assert deployed == reference_sha256(tmp_path / "reference", 2, settings)
    assert audit.main(str(coord)) == 0 and audit.replay_main(str(coord)) == 0
    out = capsys.readouterr().out
    assert "2 rounds verified" in out and "2 rounds replayed: every model SHA-256 matches" in out


def test_a_byte_level_gpt_trains_on_pystdlib_over_tls_with_the_in_process_bits(tmp_path, procs):
    """Language models deployed (``docs/language-models.md``): volunteers join with ``--data
    pystdlib``, prepare their part of their own interpreter's standard library, train a byte-level
    GPT with local AdamW; the held-out loss falls, and the bits are the in-process federation's."""
    port = launch.free_port()
    settings = Settings(rounds=3, aggregator="trimmed-mean", tolerate=0, quorum=2, deadline=60.0, port=port,
                        dataset="pystdlib", model="gpt:layers=1,width=32,heads=2,context=64", lr=0.003,
                        protocol="delta:steps=3,inner=adamw,clip=1.0", batch_size=16)
    coord, nodes = make_federation(tmp_path / "deployed", 2, settings)
    deploy(tmp_path, coord, nodes, port, procs, join_args=("--data", "pystdlib"))
    records = rounds_done(coord)
    assert [r["accepted"] for r in records] == [2, 2, 2]
    assert records[-1]["loss"] < 0.9 * records[0]["loss"], [r["loss"] for r in records]
    result = json.loads((coord / checkpoint.RESULT).read_text())
    assert result["model_sha256"] == reference_sha256(tmp_path / "reference", 2, settings)
