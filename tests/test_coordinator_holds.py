"""The coordinator never falls: hostile replies, broken files, quiet failures (issue 10).

Each test names the failure it pins: on the code before the fix, each of them fails."""

from __future__ import annotations

import io
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx
import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from nodes import checkpoint, launch
from nodes.coordinator.admission import ADMITTED, KEY_CAP, admit, scan
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.inbox import Inbox
from nodes.settings import Settings
from nodes.wire import REPLY, UPDATE, signed_payload
from robust import keys, tls
from robust.params import sha256

from .federation_kit import fingerprint, make_federation, play, replies, take

SETTINGS = Settings(rounds=8, aggregator="trimmed-mean", tolerate=1, quorum=3, protocol="delta:steps=4")


@pytest.fixture
def federation(tmp_path):
    return make_federation(tmp_path, 4, SETTINGS)


def signed(coord: Coordinator, node, data: bytes, label: str = "float32") -> RecordDict:
    """A correctly signed reply from ``node`` whose update bytes are ``data`` (labelled float32 (d,))."""
    task, _ = coord.task()
    d = coord.engine.w.numel()
    claimed = torch.from_numpy(np.zeros(d, np.float32))
    signature = keys.sign(keys.load_private(node), signed_payload(task.run, task.round, task.base, sha256(claimed), 10))
    reply = {"run": task.run, "round": task.round, "base": task.base, "count": 10, "signature": signature,
             "refused": "", "seconds": 1.0}
    array = Array(dtype=label, shape=(d,), stype="numpy.ndarray", data=data)
    return RecordDict({REPLY: ConfigRecord(reply), UPDATE: ArrayRecord({"row": array})})


def npy(values: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, values, allow_pickle=False)
    return out.getvalue()


# 1. float64 bytes under a float32 label made the model float64 and crashed every restart


def test_float64_bytes_labelled_float32_are_rejected_and_the_model_stays_float32(federation):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)
    d = coord.engine.w.numel()
    inbox = Inbox()
    for fp, content in replies(coord, nodes[1:]):
        take(coord, fp, content, inbox)
    liar = fingerprint(nodes[0])
    take(coord, liar, signed(coord, nodes[0], npy(np.zeros(d, np.float64))), inbox)
    assert "float32" in inbox.rejected[liar] and liar not in inbox.rows
    record = coord.finish_round(coord.select([fingerprint(n) for n in nodes]), inbox, 0.0)
    assert record["accepted"] == 3 and not record["skipped"]
    assert coord.engine.w.dtype == torch.float32 and coord.engine.w.shape == (d,)
    assert Coordinator(coord_dir).engine.w.dtype == torch.float32  # the restart resumes, no crash
    with pytest.raises(ValueError, match="a driver's error"):  # nor can any driver hand the engine float64
        coord.engine.step([], ["x"], torch.zeros(1, d, dtype=torch.float64))


def test_an_unexpected_error_while_checking_a_reply_is_that_nodes_rejection(federation, monkeypatch):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)

    def broken(*args):
        raise RuntimeError("a bug in the checks")

    monkeypatch.setattr(keys, "verify", broken)
    (fp, content), inbox = replies(coord, nodes[:1])[0], Inbox()
    take(coord, fp, content, inbox)
    assert inbox.rejected == {fp: "reply could not be checked (RuntimeError)"}


# 3. a bad file in admitted/ ended a running federation; admit wrote keys non-atomically


def test_a_bad_admission_file_is_skipped_with_a_warning_naming_it(federation, caplog):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)
    (coord_dir / ADMITTED / "junk.pub").write_text("not a key\n")
    (coord_dir / ADMITTED / "huge.pub").write_bytes(b"ecdsa-sha2-nistp384 " + b"A" * (KEY_CAP + 1))
    with caplog.at_level("WARNING", logger="robust.coordinator"):
        asked = coord.select([fingerprint(n) for n in nodes])  # re-read while the run goes on
        coord.select([fingerprint(n) for n in nodes])
    assert len(asked) == 4
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # once per file, not once per round
    assert any("junk.pub" in w and "not an OpenSSH public key" in w for w in warnings)
    assert any("huge.pub" in w and f"at most {KEY_CAP}" in w for w in warnings)
    found, problems = scan(coord_dir)
    assert len(found) == 4 and len(problems) == 2
    assert play(coord, nodes)["accepted"] == 4


def test_admit_refuses_an_oversized_key_and_writes_atomically(tmp_path, federation):
    coord_dir, nodes = federation
    big = tmp_path / "big.pub"
    big.write_bytes(b"ecdsa-sha2-nistp384 " + b"A" * 10 * KEY_CAP)
    with pytest.raises(ValueError, match=f"at most {KEY_CAP}"):
        admit(coord_dir, big)
    fp = admit(coord_dir, nodes[0] / keys.PUBLIC_FILE)
    files = sorted(p.name for p in (coord_dir / ADMITTED).iterdir())
    assert f"{fp}.pub" in files and not [f for f in files if f.endswith(".tmp")]


# 4. a huge reply was decoded and copied before its size was checked


def test_an_oversized_reply_is_rejected_before_it_is_decoded(federation):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)
    content = signed(coord, nodes[0], npy(np.zeros(25_000_000, np.float32)))  # 100 MB for a 4810-value model
    inbox = Inbox()
    tracemalloc.start()
    try:
        take(coord, fingerprint(nodes[0]), content, inbox)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "100000128 bytes, a model of" in next(iter(inbox.rejected.values()))
    assert peak < 1_000_000  # bytes allocated while rejecting it: nothing of the 100 MB was copied


def test_a_shape_that_lies_in_the_header_is_rejected(federation):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)
    d = coord.engine.w.numel()
    data = npy(np.zeros(d, np.float32)).replace(f"({d},)".encode(), f"({d - 1},)".encode().ljust(len(f"({d},)")))
    inbox = Inbox()
    take(coord, fingerprint(nodes[0]), signed(coord, nodes[0], data), inbox)
    assert f"bytes hold shape ({d - 1},)" in next(iter(inbox.rejected.values()))


# 5. broken state files gave tracebacks or silent restarts


@pytest.mark.parametrize("content", [b"", b"\x80\x02garbage", os.urandom(4096), "truncated"])
def test_a_checkpoint_that_does_not_load_is_refused_with_what_to_do(federation, content):
    coord_dir, nodes = federation
    play(Coordinator(coord_dir), nodes)
    path = coord_dir / checkpoint.CHECKPOINT
    path.write_bytes(path.read_bytes()[:300] if content == "truncated" else content)
    with pytest.raises(ValueError, match="does not load .*move both out of"):
        Coordinator(coord_dir)


def test_a_deleted_checkpoint_with_its_round_log_kept_is_refused(federation):
    coord_dir, nodes = federation
    play(Coordinator(coord_dir), nodes)
    (coord_dir / checkpoint.CHECKPOINT).unlink()
    with pytest.raises(ValueError, match="records 1 round.* is missing"):
        Coordinator(coord_dir)


@pytest.mark.parametrize("model, words", [
    (torch.zeros(7), "shape \\(7,\\)"),
    (torch.full((4810,), float("nan")), "non-finite"),
    (torch.zeros(4810, dtype=torch.float64), "torch.float64 model"),
])
def test_a_checkpoint_with_a_wrong_model_is_refused(federation, model, words):
    coord_dir, nodes = federation
    play(Coordinator(coord_dir), nodes)
    path = coord_dir / checkpoint.CHECKPOINT
    state = torch.load(path, weights_only=True)
    state["engine"]["w"] = model
    torch.save(state, path)
    with pytest.raises(ValueError, match=words):
        Coordinator(coord_dir)


def test_a_log_one_round_short_is_completed_and_other_disagreements_refused(federation):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)
    play(coord, nodes)
    play(coord, nodes)
    log = coord_dir / checkpoint.ROUNDS
    full = log.read_text()
    log.write_text(full.splitlines(keepends=True)[0] + full.splitlines()[1][:40])  # killed writing round 2's line
    assert Coordinator(coord_dir).round == 2 and log.read_text() == full  # completed from the checkpoint
    log.write_text(full.splitlines(keepends=True)[0] * 3)
    with pytest.raises(ValueError, match="does not number its rounds"):
        Coordinator(coord_dir)
    log.write_text("")
    with pytest.raises(ValueError, match="at round 2 but .* records 0"):
        Coordinator(coord_dir)


def test_the_coordinators_supervisor_loads_neither_torch_nor_flower(federation):
    """``coordinator start`` checks its folder in a child process (the settings, whose checks
    build the rules; the checkpoint; the disk) and then only follows the run: the engine,
    PyTorch and Flower stay out of it, and the settings it gets back are the checked ones."""
    coord_dir, _ = federation
    code = ("import sys\nfrom pathlib import Path\nfrom nodes import commands\n"
            "from nodes.coordinator.precheck import checked\n"
            "if __name__ == '__main__':\n"
            f"    settings, done, disk = checked(Path({str(coord_dir)!r}), {{'rounds': 7}})\n"
            "    print(settings.rounds, settings.quorum_needed, done, disk.row > 0,\n"
            "          sorted(m for m in ('torch', 'flwr', 'nodes.coordinator.coordinator') if m in sys.modules))\n")
    script = coord_dir.parent / "supervisor.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    expected = Settings.read(coord_dir)
    assert expected.rounds == 7  # written to the folder by the child
    assert done.stdout.split() == ["7", str(expected.quorum_needed), "0", "True", "[]"]


def test_start_refuses_a_broken_checkpoint_in_one_line(federation, capsys):
    from robust.cli import main

    coord_dir, nodes = federation
    play(Coordinator(coord_dir), nodes)
    (coord_dir / checkpoint.CHECKPOINT).write_bytes(b"")
    assert main(["coordinator", "start", str(coord_dir)]) == 2
    err = capsys.readouterr().err
    assert "does not load" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, words", [
    ({"bind": "999.1.1.1"}, "settings: bind must be an IP address or a host name (got bind='999.1.1.1')"),
    ({"bind": "bad host"}, "settings: bind must be an IP address or a host name"),
    ({"port": 70000}, "settings: port must be an integer in [1, 65535] (got port=70000)"),
    ({"momentum": "high"}, "settings: momentum must be a number in [0, 1) (got momentum='high')"),
])
def test_deployment_settings_are_validated(change, words):
    with pytest.raises(ValueError, match=words.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
        Settings().replace(**change)
    for host in ("0.0.0.0", "::", "coordinator.example.org", "localhost"):
        assert Settings(bind=host).bind == host


# 6. quiet failures


def test_non_finite_numbers_never_reach_the_json_logs(tmp_path):
    checkpoint.append_round(tmp_path, {"round": 1, "seconds": float("inf"), "scores": {"x": [1.0, float("nan")]}})
    line = (tmp_path / checkpoint.ROUNDS).read_text()
    assert json.loads(line) == {"round": 1, "seconds": None, "scores": {"x": [1.0, None]}}
    assert "Infinity" not in line and "NaN" not in line


def test_a_node_that_keeps_declining_is_rested_not_flagged(federation):
    coord_dir, nodes = federation
    coord = Coordinator(coord_dir)
    decliner, everyone = fingerprint(nodes[0]), [fingerprint(n) for n in nodes]
    asked = []
    for _ in range(7):
        asked.append(decliner in coord.select(everyone))
        record = play(coord, nodes, {1: "decline"})
        assert record["skipped"] == "" and decliner not in record["flagged"]
    assert asked == [True, True, True, False, False, False, True]  # rested for 3 rounds after 3 declines
    assert coord.attendance.declined == {decliner: 4}
    assert Coordinator(coord_dir).attendance.state() == coord.attendance.state()  # checkpointed


def test_resting_never_costs_the_quorum(tmp_path):
    coord_dir, nodes = make_federation(tmp_path, 3, SETTINGS)
    coord = Coordinator(coord_dir)
    for _ in range(3):
        play(coord, nodes, {1: "decline"})
    assert coord.attendance.rested(coord.round + 1) == {fingerprint(nodes[0])}
    assert len(coord.select([fingerprint(n) for n in nodes])) == 3  # 2 would be below the quorum of 3


class _TLSServer:
    """A TLS server on loopback with the certificate made in ``folder`` (a coordinator's)."""

    def __init__(self, folder) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(folder / tls.SERVER_CERT, folder / tls.SERVER_KEY)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass


def test_node_join_says_when_the_certificate_does_not_verify_against_ca(tmp_path):
    ours = tls.make_certificates(tmp_path / "ours")
    theirs = tls.make_certificates(tmp_path / "theirs")
    server = _TLSServer(tmp_path / "ours")
    try:
        assert launch.check_certificate(f"127.0.0.1:{server.port}", ours) is None
        with pytest.raises(ValueError, match="the coordinator's certificate does not verify against --ca"):
            launch.check_certificate(f"127.0.0.1:{server.port}", theirs)
    finally:
        server.sock.close()
    assert launch.check_certificate(f"127.0.0.1:{launch.free_port()}", ours).startswith("ConnectionRefusedError")
    (tmp_path / "not-a-cert").write_text("hello\n")
    with pytest.raises(ValueError, match="is not a PEM certificate"):
        launch.check_certificate("127.0.0.1:1", tmp_path / "not-a-cert")


def test_a_run_with_no_volunteer_online_fails_with_what_to_do(federation, capsys):
    """Real SuperLink and ServerApp, no volunteer started: never "done" on an untrained model.
    Its dashboard (``--dashboard``) answers while the coordinator runs, and goes with it."""
    from robust.cli import main

    coord_dir, _ = federation
    board, seen = f"http://127.0.0.1:{launch.free_port()}/api/status", []

    def look() -> None:  # until the dashboard answers that the run is going
        for _ in range(600):
            try:
                seen.append(httpx.get(board, timeout=2).json())
                if seen[-1].get("state") == "running":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    code = main(["coordinator", "start", str(coord_dir), "--wait-nodes", "2", "--port", str(launch.free_port()),
                 "--dashboard", board.split("/")[2]])
    watcher.join(timeout=5)
    out = capsys.readouterr().out
    assert seen and seen[-1]["state"] == "running" and seen[-1]["round"] == 0, seen[-1:]
    with pytest.raises(httpx.HTTPError):  # stopped with the coordinator
        httpx.get(board, timeout=2)
    assert code == 1 and "done" not in out
    assert "no admitted volunteer is online after waiting 2 s" in out and "robust node join" in out
    assert not (coord_dir / checkpoint.RESULT).exists() and not (coord_dir / checkpoint.ROUNDS).exists()
