"""What reaching the target accuracy costs (evaluation.reports.target_costs) and the report's bytes to
target (evaluation.reports.communication_section): by hand on made-up records, and on real cells."""

import copy
import json
import math

import pytest

from evaluation.bench.cell import Cell
from evaluation.reports.communication_section import bytes_frontier, communication_section, pareto, short
from evaluation.bench.drivers.inprocess import run_cell
from evaluation.reports.results import Results
from evaluation.bench.scenario import cell_id, load_scenario
from evaluation.reports.target_costs import FIELDS, complete, costs, first_reached

BASE = {"dataset": "digits", "model": "mlp", "nodes": 10, "byzantine": 2, "rounds": 8, "partition": "iid",
        "alpha": 1.0, "protocol": "momentum", "step-seconds": 0.01}


def made(attack: str, accuracy: list[float], up: int, down: int, seed: int = 0, **config) -> dict:
    """A record as a local cell writes it: ``up``/``down`` bytes each round."""
    rounds = len(accuracy)
    return {"aggregator": "median", "attack": attack, "seed": seed, "sweep": None,
            "config": {"dataset": "digits", "protocol": "momentum", "compression": "none", "downlink": "none",
                       **config},
            "accuracy": accuracy, "final_accuracy": accuracy[-1], "times": [0.5 * (t + 1) for t in range(rounds)],
            "bytes": [up * (t + 1) for t in range(rounds)], "bytes_down_by_round": [down * (t + 1) for t in range(rounds)],
            "bytes_up": up * rounds, "bytes_down": down * rounds, "false_quarantines": 0, "detect": {}}


def test_first_reached_and_costs():
    assert first_reached([0.3, 0.8, 0.9], 0.8) == 1
    assert first_reached([0.3, 0.7, 0.75], 0.8) is None
    assert first_reached([math.nan, 0.6], 0.5) == 1
    assert first_reached([], 0.5) is None
    r = made("none", [0.2, 0.5, 0.9, 0.95], up=10, down=40)
    assert costs(r, 0.85) == {"round_to_target": 2, "time_to_target": 1.5, "bytes_up_to_target": 30,
                              "bytes_down_to_target": 120}
    assert costs(r, 0.99) == dict.fromkeys(FIELDS)
    assert costs(r, None) == dict.fromkeys(FIELDS)
    assert costs({**r, "times": None, "bytes": None}, 0.85)["bytes_up_to_target"] is None  # a driver without a clock
    with pytest.raises(ValueError, match="one entry per round"):
        costs({**r, "bytes": [1, 2]}, 0.85)


def test_each_task_has_its_own_bar_and_the_records_are_not_changed():
    digits = [made("none", [0.5, 0.96], 10, 40), made("none", [0.5, 0.9, 0.97], 1, 40, compression="sign"),
              made("alie", [0.5, 0.92], 10, 40)]
    other = [made("none", [0.3, 0.6], 10, 40, dataset="mnist1d")]
    records = digits + other
    before = copy.deepcopy(records)
    done = complete(records)
    assert records == before
    assert [r["target_bar"] for r in done] == pytest.approx([0.95 * 0.97] * 3 + [0.95 * 0.6])
    assert [r["round_to_target"] for r in done] == [1, 2, None, 1]
    assert done[1]["bytes_up_to_target"] == 3 and done[2]["bytes_up_to_target"] is None
    absolute = made("none", [0.5, 0.8], 10, 40, **{"target-accuracy": 0.7})
    assert complete([absolute])[0]["target_bar"] == 0.7 and complete([absolute])[0]["bytes_up_to_target"] == 20
    assert complete([made("alie", [0.5, 0.9], 10, 40)])[0]["target_bar"] is None  # no clean cell, no bar


def test_a_cell_with_an_absolute_target_records_what_reaching_it_cost():
    plain = run_cell(Cell(BASE, "median", "none", 0))
    assert "target_bar" not in plain and plain["bytes_down_by_round"][-1] == plain["bytes_down"]
    assert plain["bytes"][-1] == plain["bytes_up"]
    bar = 0.5 * plain["final_accuracy"]
    cell = run_cell(Cell({**BASE, "target-accuracy": bar}, "median", "none", 0))
    first = next(t for t, a in enumerate(cell["accuracy"]) if a >= bar)
    assert cell["target_bar"] == bar and cell["round_to_target"] == first
    assert cell["bytes_up_to_target"] == cell["bytes"][first] > 0
    assert cell["bytes_down_to_target"] == cell["bytes_down_by_round"][first] > 0
    assert cell["model_sha256"] == plain["model_sha256"]  # the bar measures, it does not change the run
    never = run_cell(Cell({**BASE, "target-accuracy": 1.0}, "median", "none", 0))
    assert all(never[k] is None for k in FIELDS)
    assert load_scenario(None, ["target-accuracy=0.9"])["target-accuracy"] == 0.9
    with pytest.raises(ValueError, match="target-accuracy"):
        load_scenario(None, ["target-accuracy=1.5"])


def test_the_report_compares_ways_of_sending_against_the_float32_momentum_baseline(tmp_path):
    records = []
    for seed in (0, 1):
        records += [made("none", [0.5, 0.9, 0.96], 100, 400, seed), made("alie", [0.5, 0.8, 0.95], 100, 400, seed),
                    made("none", [0.5, 0.96, 0.96], 1, 400, seed, compression="sign"),
                    made("alie", [0.5, 0.93, 0.94], 1, 400, seed, compression="sign"),
                    made("none", [0.5, 0.6, 0.7], 2, 400, seed, compression="topk:k=0.01"),
                    made("alie", [0.5, 0.6, 0.6], 2, 400, seed, compression="topk:k=0.01")]
    lines = communication_section(Results(records))
    assert lines[0] == "## Bytes to target"
    rows = {line.split(" | ")[0]: line.split(" | ") for line in lines if line.startswith("| median")}
    sign = rows["| median (compression=sign)"]
    # the baseline reaches 0.912 at round 1 clean but round 2 under alie: 300 bytes; sign at round 1: 2 bytes
    assert sign[1:4] == ["2e-06", "0.0008", "150.0x"] and sign[8] == "alie" and sign[9] == "1.0"
    assert rows["| median (compression=none)"][3] == "1.0x"
    assert rows["| median (compression=topk:k=0.01)"][1] == "never"
    assert communication_section(Results([made("none", [0.5, 0.9], 1, 1)])) == []  # one way: no section
    [png] = bytes_frontier(records, tmp_path / "bytes_frontier.png")
    assert png.stat().st_size > 10_000
    assert bytes_frontier([made("none", [0.5, 0.9], 1, 1)], tmp_path / "none.png") == []


def test_a_bar_of_the_baseline_for_a_task_whose_best_bar_it_never_reaches():
    """mnist1d's case: 16 local steps a round train to 58%, momentum to 47%; against 0.95 x
    58% momentum never gets there, against 0.95 x its own 47% every way can be compared."""
    records = [made("none", [0.3, 0.45, 0.47], 100, 40), made("alie", [0.3, 0.44, 0.46], 100, 40),
               *(made(attack, accuracy, 1, 40, protocol="delta:steps=16", compression="sign")
                 for attack, accuracy in (("none", [0.4, 0.5, 0.58]), ("alie", [0.35, 0.44, 0.5])))]
    best = complete(records)
    assert best[0]["target_bar"] == pytest.approx(0.95 * 0.58) and best[0]["bytes_up_to_target"] is None
    of = [{**r, "config": {**r["config"], "target-of": "baseline"}} for r in records]
    done = complete(of)
    assert [r["target_bar"] for r in done] == pytest.approx([0.95 * 0.47] * 4)  # 0.4465
    assert [r["round_to_target"] for r in done] == [1, 2, 1, 2]
    assert [r["target_bar"] for r in complete(of[2:])] == [None, None]  # no baseline cell, no bar
    rows = {line.split(" | ")[0]: line.split(" | ") for line in communication_section(Results(of))
            if line.startswith("| median")}
    # the baseline's clean run: 200 bytes up to 0.4465; the local way's worst (alie): 3 bytes
    assert rows["| median (protocol=delta:steps=16, compression=sign)"][1:4] == ["3e-06", "0.00012", "66.7x"]
    assert load_scenario(None, ['target-of="baseline"'])["target-of"] == "baseline"
    with pytest.raises(ValueError, match="target-of"):
        load_scenario(None, ["target-of=worst"])


def test_pareto_keeps_what_nothing_beats_on_both_and_ways_read_short():
    assert pareto([(1, 90), (2, 95), (3, 94), (0.5, 80), (2, 93)]) == [(0.5, 80), (1, 90), (2, 95)]
    config = {"protocol": json.dumps("delta:steps=16,server_lr=0.7,server_momentum=0.9,nesterov=true"),
              "compression": json.dumps("sign"), "downlink": json.dumps("fp16")}
    assert short(config, ["protocol", "compression", "downlink"]) == "K=16 nesterov, sign, downlink=fp16"
    assert short({"protocol": json.dumps("delta:server_momentum=0.5")}, ["protocol"]) == "K=10 mu=0.5"
    assert short({"protocol": json.dumps("momentum")}, ["protocol", "compression"]) == "momentum, —"


def test_a_real_grid_reports_bytes_to_target(tmp_path):
    from evaluation.reports.summary import write_report

    lines = []
    for codec in ("none", "sign"):
        for attack in ("none", "sign-flip"):
            cell = Cell({**BASE, "compression": codec}, "median", attack, 0)
            lines.append(json.dumps({**run_cell(cell), "cell": cell_id(cell)}))
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    paths = write_report(tmp_path / "results.jsonl", tmp_path)
    summary = paths[0].read_text()
    assert "## Bytes to target" in summary and "| median (compression=sign) |" in summary
    assert any(p.name == "bytes_frontier.png" for p in paths)
