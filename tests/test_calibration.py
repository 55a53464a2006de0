"""The field's calibration of the simulated clock: measured from a lab run's observations,
checked when read, and applied by the clock as a pure function of the scenario, the seed and
the file."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from evaluation.simtime import timeline
from evaluation.simtime.arrivals import CLOCK
from evaluation.simtime.calibration import Calibration, load, measure
from evaluation.simtime.serve_clock import SimClock

IDS = ["a" * 64, "b" * 64, "c" * 64]
SETTINGS = SimpleNamespace(compression="none", downlink="none")


def observed(tasks, collect, between, first, up=(1000, 1100), down=(4000, 4400)) -> dict:
    return {"task_seconds": tasks, "collect_seconds": collect, "between_seconds": between, "first_task_seconds": first,
            "up_bytes": up[0], "wire_up_bytes": up[1], "down_bytes": down[0], "wire_down_bytes": down[1]}


def test_measure_pools_the_cells_and_takes_medians():
    cal = measure([observed([3.0, 1.0], [0.5, 0.7], [0.2], 6.0), observed([2.0], [0.6], [0.4, 0.3], 8.0, (1000, 1300))],
                  "test")
    assert cal.task_seconds == (1.0, 2.0, 3.0)  # every sample kept: a round waits for its largest
    assert cal.collect_seconds == 0.6 and cal.between_seconds == 0.3
    assert cal.start_seconds == pytest.approx(7.0 - 0.3)  # the first task, less the gap every task has
    assert cal.wire_up == pytest.approx(2400 / 2000) and cal.wire_down == pytest.approx(8800 / 8000)
    with pytest.raises(ValueError, match="at least 3 rounds"):
        measure([observed([1.0], [0.5], [], 6.0)], "one round")


def test_a_file_is_checked_when_read(tmp_path):
    good = Calibration((1.0, 2.0), 0.5, 0.3, 4.0, 1.05, 1.02, "test")
    path = tmp_path / "cal.json"
    good.save(path)
    assert load(str(path)) == good and load("") is None
    CLOCK["calibration"].check(str(path))  # a scenario key, checked up front
    for bad, words in [({**json.loads(path.read_text()), "wire_up": 0.5}, "wire bytes per byte"),
                       ({"task_seconds": [1.0]}, "lacks collect_seconds"),
                       ({**json.loads(path.read_text()), "task_seconds": []}, "task_seconds")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=words):
            load(str(path))
    with pytest.raises(ValueError, match="robust field --calibrate"):
        CLOCK["calibration"].check(str(tmp_path / "missing.json"))


def test_the_clock_adds_what_the_field_adds(tmp_path):
    cal = Calibration((1.0, 2.0, 3.0), 0.5, 0.25, 4.0, 1.1, 1.2, "test")
    path = tmp_path / "cal.json"
    cal.save(path)
    config = {"step-seconds": 0.1, "link": "home:up_mbps=8,down_mbps=80,latency_ms=10"}
    plain = timeline.Timeline(config, IDS, 0, SETTINGS, 2, 1_000_000)
    lines = [timeline.Timeline({**config, "calibration": str(path)}, IDS, 0, SETTINGS, 2, 1_000_000) for _ in range(2)]
    assert plain.now == 0.0 and lines[0].now == 4.0  # the run starts when the field's first task goes
    got = [[line.arrival(node, 10.0, 4_000_000) for node in IDS for _ in range(3)] for line in lines]
    assert got[0] == got[1]  # a pure function of the scenario, the seed and the file
    for k, node in enumerate(IDS):
        base = plain.volunteers
        wire = base.arrival(node, 10.0, 2, 0.1, 4_400_000, 4_800_000)  # the wire's bytes each way
        added = [t - wire - 0.25 for t in got[0][3 * k : 3 * k + 3]]  # between, then a task's sample
        assert all(any(a == pytest.approx(s) for s in cal.task_seconds) for a in added), added
    assert len({round(t, 6) for t in got[0]}) > 1  # the tasks' overheads are drawn, not one constant
    assert statistics.mean(got[0]) > plain.arrival(IDS[0], 10.0, 4_000_000)
    clocks = [SimClock(line, True, 60.0, IDS) for line in (plain, lines[0])]
    for clock in clocks:
        clock.stepping()  # each step of the engine: the coordinator's collect, one after the other
        clock.stepping()
    assert [c.now() for c in clocks] == [0.0, 4.0 + 2 * 0.5]


def test_a_lab_runs_observations_are_read_from_its_logs():
    from evaluation.field.lab.observe import observe
    from evaluation.simtime.arrivals import Volunteers

    crowd = Volunteers.of(IDS[:2], 0, link="home:up_mbps=8,down_mbps=80,latency_ms=100")
    t0 = 1000.0

    def reply(r, made, handed, trained):
        return {"run": "x", "round": r, "kind": "training", "time": t0 + handed, "task_made": t0 + made,
                "seconds": trained, "bytes": 400}

    replies = {IDS[0]: [reply(1, 5.0, 8.0, 1.0), reply(2, 12.0, 14.0, 1.0)],
               IDS[1]: [reply(1, 5.0, 9.0, 0.5), reply(2, 12.0, 15.5, 0.5)]}
    rounds = [{"round": 1, "ids": IDS[:2], "rejected": {}}, {"round": 2, "ids": [IDS[0]], "rejected": {IDS[1]: "why"}}]
    got = observe(replies, rounds, t0, [10.0, 17.0], crowd, 100, "none", {IDS[0]: (500, 900), IDS[1]: (450, 800)})
    download = 0.1 + 8 * 400 / 80e6  # each task's model, 100 float32 values, on its link
    assert got["task_seconds"] == pytest.approx([8.0 - 5 - 1 - download, 9 - 5 - 0.5 - download,
                                                 14 - 12 - 1 - download, 15.5 - 12 - 0.5 - download], abs=1e-4)
    assert got["collect_seconds"] == [1.0, 1.5]  # the last counted reply to the record (a rejection counts)
    assert got["between_seconds"] == [2.0]  # the record to the next round's first task
    assert got["first_task_seconds"] == 5.0
    assert (got["up_bytes"], got["wire_up_bytes"], got["down_bytes"], got["wire_down_bytes"]) == (1600, 950, 1600, 1700)
