"""``robust coordinator status DIR``: a run at a glance from its folder alone, while it runs and
after; and the live bars of ``robust bench`` and ``robust coordinator start``, which leave
plain lines when the output is not a terminal."""

from __future__ import annotations

import json
import re
import socket
import types

import pytest

from evaluation.bench.run_grid import Progress
from nodes import checkpoint, commands, launch
from nodes.coordinator.admission import short
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.status import read, read_rounds, sparkline
from nodes.settings import Settings
from robust.cli import main

from .federation_kit import fingerprint, make_federation, play

SETTINGS = Settings(rounds=4, aggregator="trimmed-mean", tolerate=1, quorum=3, protocol="delta:steps=4",
                    quarantine_after=2)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the width: keep each line whole


@pytest.fixture
def run(tmp_path):
    """A coordinator folder 3 rounds into 4, made by the real Coordinator: node 4 sends NaN,
    is rejected in rounds 1 and 2 and quarantined at its second flag (not asked in round 3)."""
    coord_dir, nodes = make_federation(tmp_path, 5, SETTINGS.replace(port=launch.free_port()))
    coord = Coordinator(coord_dir)
    records = [play(coord, nodes, {4: "nan"}) for _ in range(3)]
    return types.SimpleNamespace(dir=coord_dir, nodes=nodes, coord=coord, records=records,
                                 bad=short(fingerprint(nodes[3])))


def status(folder, capsys, *extra: str) -> tuple[int, str, str]:
    code = main(["coordinator", "status", str(folder), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_gives_the_round_the_accuracy_and_the_bad_node(run, capsys):
    code, out, _ = status(run.dir, capsys, "--json")
    got = json.loads(out)
    assert code == 0 and got["state"] == "stopped" and (got["round"], got["rounds"]) == (3, 4)
    accuracies = [r["accuracy"] for r in run.records]
    assert got["accuracy"]["recent"] == [[i, a] for i, a in enumerate(accuracies, start=1)]
    assert got["accuracy"]["best"] == max(accuracies) and got["accuracy"]["last"] == accuracies[-1]
    nodes = got["nodes"]
    everyone = sorted(short(fingerprint(n)) for n in run.nodes)
    assert nodes["admitted"] == everyone and nodes["online"] == [fp for fp in everyone if fp != run.bad]
    assert nodes["flagged"] == {run.bad: 2} and nodes["quarantined"] == {run.bad: 2} and nodes["convicted"] == {}
    assert nodes["quarantined_by"] == {run.bad: "flags"}
    assert got["rejections"] == [{"round": 2, "node": run.bad, "reason": "non-finite values"},
                                 {"round": 1, "node": run.bad, "reason": "non-finite values"}]
    code, text, _ = status(run.dir, capsys)
    assert code == 0 and "round 3/4" in text and "5 admitted, 4 replied in round 3, 1 flagged, 1 quarantined, 0 convicted" in text
    assert f"{run.bad} x2" in text and f"{run.bad} (round 2, flags)" in text and "non-finite values" in text
    assert f"`robust coordinator start {run.dir}` resumes after round 3" in text


def test_a_line_cut_short_is_left_out_and_the_log_is_never_written(run):
    log = run.dir / checkpoint.ROUNDS
    before = log.read_bytes()
    log.write_bytes(before + before.splitlines(keepends=True)[0][:50])  # a round being written
    assert read(run.dir)["round"] == 3
    assert log.read_bytes() == before + before.splitlines(keepends=True)[0][:50]  # the coordinator's file
    log.write_bytes(before.replace(b'"round": 2', b'"round": 7'))
    with pytest.raises(ValueError, match="line 2 is not a round record .*robust audit verify"):
        read(run.dir)


def test_the_run_is_running_while_its_superlink_answers(run):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", Settings.read(run.dir).port))
        listener.listen()
        assert read(run.dir)["state"] == "running"
    assert read(run.dir)["state"] == "stopped"


def test_a_finished_run_gives_its_model_and_a_failed_one_its_reason(run, capsys):
    last = play(run.coord, run.nodes, {4: "nan"})
    result = json.loads((run.dir / checkpoint.RESULT).read_text())
    got = read(run.dir)
    assert (got["state"], got["round"], got["model_sha256"]) == ("finished", 4, last["model_sha256"])
    assert got["final_accuracy"] == result["final_accuracy"] == last["accuracy"]
    code, text, _ = status(run.dir, capsys)
    assert code == 0 and "finished" in text and f"model SHA-256 {last['model_sha256']}" in text
    (run.dir / checkpoint.RESULT).unlink()
    checkpoint.write_failure(run.dir, RuntimeError("the data set is gone"))
    got = read(run.dir)
    assert got["state"] == "failed" and got["failure"] == "RuntimeError: the data set is gone"


def test_a_folder_that_is_not_a_coordinator_is_one_line_saying_what_to_do(tmp_path, capsys):
    for folder in (tmp_path, tmp_path / "missing"):
        code, out, err = status(folder, capsys)
        assert code == 2 and not out and len(err.strip().splitlines()) == 1
        assert f"{folder} is not a coordinator folder" in err and "robust coordinator init DIR" in err
    coord, _ = commands.local_federation(tmp_path / "new", 3, SETTINGS, "fresh", ("status", 0))
    got = read(coord)
    assert (got["state"], got["round"], got["rejections"], got["accuracy"]["last"]) == ("stopped", 0, [], None)
    text = status(coord, capsys)[1]
    assert len(got["nodes"]["admitted"]) == 3 and "not started" in text and f"robust coordinator start {coord}` starts it" in text


def test_sparkline_spans_lowest_to_highest():
    assert sparkline([0.1, 0.5, 0.9, None, 0.9]) == "▁▅█ █" and sparkline([0.3, 0.3]) == "▁▁"


def _follow_all(run, monkeypatch) -> None:
    """``_follow`` over a finished run, every round of it new (as if recorded while it watched)."""
    play(run.coord, run.nodes, {4: "nan"})
    monkeypatch.setattr(commands, "rounds_file_size", lambda folder: 0)
    superlink = types.SimpleNamespace(poll=lambda: None)
    assert commands._follow(run.dir, "run", Settings.read(run.dir), superlink) == 0


def test_coordinator_round_lines_are_plain_off_a_terminal(run, monkeypatch, capsys):
    _follow_all(run, monkeypatch)
    result = json.loads((run.dir / checkpoint.RESULT).read_text())
    lines = [commands._describe(r, 4) for r in read_rounds(run.dir)]
    assert capsys.readouterr().out.splitlines() == [
        *lines, f"done: final accuracy {result['final_accuracy']:.4f}, model SHA-256 {result['model_sha256']}",
        f"  model {run.dir / 'model.pt'}, per-round log {run.dir / checkpoint.ROUNDS}"]
    assert lines[0].startswith("round 1/4  accepted 4/5  rejected ") and "non-finite values" in lines[0]


def test_coordinator_shows_a_live_bar_at_a_terminal(run, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: this output is a terminal
    _follow_all(run, monkeypatch)
    out = ANSI.sub("", capsys.readouterr().out)
    assert all(commands._describe(r, 4) in out for r in read_rounds(run.dir))
    assert re.search(r"4/4 rounds .* accuracy 0\.\d{3}", out) and "done: final accuracy" in out


RECORD = {"aggregator": "median", "attack": "alie", "seed": 3, "final_accuracy": 0.912}


def test_bench_progress_is_one_line_per_cell_in_a_log(capsys):
    with Progress(total=3, done=1) as progress:
        progress.update(RECORD)
    assert progress.done == 2
    assert capsys.readouterr().err == "2/3 cells | median vs alie seed 3: accuracy 91.2%\n"


def test_bench_progress_is_a_bar_at_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    with Progress(total=3, done=1) as progress:
        progress.update(RECORD)
        progress.update(RECORD)
    err = ANSI.sub("", capsys.readouterr().err)
    assert progress.done == 3 and "3/3 cells" in err and "accuracy 91.2%" in err and "3/3 cells |" not in err
