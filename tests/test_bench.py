"""robust bench end to end: grid expansion, resume, parallel cells, determinism, report."""

import json
import statistics
import subprocess
import sys

import pytest
import torch

from evaluation.bench.cell import Cell, backdoor_success
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from evaluation.bench.scenario import cell_id, cells, grid, load_scenario, sweep_specs

TINY = [
    "rounds=4", "nodes=7", "byzantine=1", "seeds=[0]", "dataset=synthetic", "model=logreg", "protocol=momentum",
    'aggregators=["mean","trimmed-mean"]', 'attacks=["none","alie","label-flip"]',
]


def bench(out, *extra):
    cmd = [sys.executable, "-m", "robust.cli", "bench", "--out", str(out)]
    for item in TINY:
        cmd += ["--set", item]
    return subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=600)


def records(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_grid_expands_list_values_and_axes():
    scenario = load_scenario(None, TINY + ["alpha=[0.1, 1.0]", "partition=dirichlet"])
    assert len(grid(scenario)) == 2
    assert len(cells(scenario)) == 2 * 2 * 3
    assert len({cell_id(c) for c in cells(scenario)}) == 12


def test_scenario_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="scenario: unknown key node "):
        load_scenario(None, ["node=3"])
    with pytest.raises(ValueError, match="krum needs n >= 2f \\+ 3"):
        load_scenario(None, ["nodes=6", "byzantine=2", 'aggregators=["krum"]'])
    with pytest.raises(ValueError, match="scenario: dataset must be one of digits, .* \\(got dataset='imagenet'\\)"):
        load_scenario(None, ["dataset=imagenet"])
    with pytest.raises(ValueError, match="not found"):
        load_scenario(str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("rounds = 3\n")
    with pytest.raises(ValueError, match="no \\[scenario\\] table"):
        load_scenario(str(tmp_path / "bad.toml"))


def test_sweep_specs():
    specs = sweep_specs("alie:z=0.5..2", 4)
    assert [s for s, _ in specs] == ["alie:z=0.5", "alie:z=1", "alie:z=1.5", "alie:z=2"]
    assert specs[1][1] == {"attack": "alie", "param": "z", "value": 1.0}
    with pytest.raises(ValueError, match="LOW..HIGH"):
        sweep_specs("alie:z=1", 4)
    # any parameter, the others fixed; an integer one takes whole values
    assert [s for s, _ in sweep_specs("gaussian:mu=1,sigma=0..10", 3)] == [
        "gaussian:mu=1,sigma=0", "gaussian:mu=1,sigma=5", "gaussian:mu=1,sigma=10"]
    assert [v["value"] for _, v in sweep_specs("optimal-alie:steps=2..5", 8)] == [2, 3, 4, 5]
    assert [s for s, _ in sweep_specs("mimic:node=0..2", 3)] == ["mimic:node=0", "mimic:node=1", "mimic:node=2"]


def test_cell_is_deterministic_and_per_node_mode_matches():
    cfg = grid(load_scenario(None, TINY))[0]
    a = run_cell(Cell(cfg, "trimmed-mean", "alie", 0))
    b = run_cell(Cell(cfg, "trimmed-mean", "alie", 0))
    assert a["model_sha256"] == b["model_sha256"]
    slow = run_cell(Cell(cfg, "trimmed-mean", "alie", 0), vectorize=False)
    assert slow["final_accuracy"] == pytest.approx(a["final_accuracy"], abs=0.02)
    assert a["model_sha256"] != run_cell(Cell(cfg, "trimmed-mean", "alie", 1))["model_sha256"]


def test_inf_rows_are_rejected_and_the_run_goes_on():
    cfg = grid(load_scenario(None, TINY))[0]
    record = run_cell(Cell(cfg, "trimmed-mean", "inf", 0))
    clean = run_cell(Cell(cfg, "trimmed-mean", "none", 0))
    # one node, rejected in rounds 1-3, then quarantined (the flag policy's third flag): not asked in round 4
    assert record["rejected"] == 3 and record["skipped_rounds"] == 0
    assert list(record["rounds_to_quarantine"].values()) == [2] and record["caught_round"] == 2
    assert record["false_quarantines"] == 0
    assert record["accuracy"][-1] > record["accuracy"][0]  # training went on with 6 rows
    assert record["final_accuracy"] == pytest.approx(clean["final_accuracy"], abs=0.02)


def test_bench_runs_resumes_and_reports(tmp_path):
    out = tmp_path / "run"
    first = bench(out, "--speed")
    assert first.returncode == 0, first.stderr
    assert "report:" in first.stdout and "speed:" in first.stdout
    rows = records(out)
    assert len(rows) == 6 and {r["attack"] for r in rows} == {"none", "alie", "label-flip"}
    for r in rows:
        assert 0 <= r["final_accuracy"] <= 1 and len(r["accuracy"]) == 4
        assert set(r["detect"]) >= {"norm", "krum-score", "spectral"}
    summary = (out / "summary.md").read_text()
    assert "## Accuracy" in summary and "## Speed" in summary
    speed = json.loads((out / "speed.json").read_text())
    assert speed["speedup"] == pytest.approx(speed["engine_node_steps_per_s"] / speed["plain_loop_node_steps_per_s"])
    assert speed["engine_training_node_steps_per_s"] > speed["engine_mean_cell_node_steps_per_s"] > 0
    assert speed["training_speedup"] > 0
    assert f"**{speed['training_speedup']:.1f}x**" in summary
    assert all((out / name).stat().st_size > 1000 for name in ("heatmap.png", "accuracy_curves.png"))
    again = bench(out)  # everything is finished: nothing runs twice
    assert "6 cells (6 already in" in again.stderr and len(records(out)) == 6
    assert "speed:" not in again.stdout  # timed only when asked

    parallel = tmp_path / "jobs"
    assert bench(parallel, "--jobs", "2").returncode == 0
    shas = {r["cell"]: r["model_sha256"] for r in rows}
    assert {r["cell"]: r["model_sha256"] for r in records(parallel)} == shas


def test_bench_sweep_writes_the_frontier(tmp_path):
    out = tmp_path / "sweep"
    done = bench(out, "--sweep", "ipm:eps=0.1..2", "--sweep-points", "2")
    assert done.returncode == 0, done.stderr
    rows = records(out)
    clean = {r["aggregator"]: r["final_accuracy"] for r in rows if r["attack"] == "none"}
    swept = [r for r in rows if r["sweep"]]
    assert sorted((r["aggregator"], r["attack"]) for r in swept) == [
        (a, f"ipm:eps={v}") for a in ("mean", "trimmed-mean") for v in ("0.1", "2")]
    summary = (out / "summary.md").read_text()
    frontier = summary.split("## Stealth frontier")[1].split("\n## ")[0]
    assert "| mean | " in frontier and "| trimmed-mean | " in frontier  # one row per defence
    sweep = summary.split("## Sweeps")[1].split("\n## ")[0]
    assert "### ipm\n\n| eps | damage (pp) | best detector | AUC |" in sweep
    for value in (0.1, 2.0):  # damage: clean minus swept final accuracy, mean over the two defences
        damage = statistics.fmean(clean[r["aggregator"]] - r["final_accuracy"]
                                  for r in swept if r["sweep"]["value"] == value)
        assert f"\n| {value:g} | {100 * damage:.1f} | " in sweep
    assert "none stays below AUC 0.6" in sweep  # measured: every ipm point has a detector at AUC 1.00
    assert (out / "stealth_frontier.png").exists()


def test_bench_reports_a_bad_scenario_without_a_traceback(tmp_path):
    done = bench(tmp_path / "x", "--set", "nodes=2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error:" in done.stderr


def test_backdoor_cell_reports_its_success_rate():
    cfg = grid(load_scenario(None, TINY))[0]
    cell = Cell(cfg, "mean", "backdoor:gamma=5", 0)
    clean = CellRun(Cell(cfg, "mean", "none", 0))
    for _ in range(4):
        clean.play_round()
    assert clean.record(1.0)["backdoor_asr"] is None
    floor = backdoor_success(CellRun(cell).setup, clean.engine.w)  # the trigger on a model nobody backdoored
    # measured (seed 0): 0.004 on the clean model, 1.0 under mean, 0.004 under trimmed-mean
    assert floor < 0.2 and run_cell(cell)["backdoor_asr"] > floor + 0.6
    assert run_cell(Cell(cfg, "trimmed-mean", "backdoor:gamma=5", 0))["backdoor_asr"] < floor + 0.2


def test_node_side_scaling_leaves_the_worker_momentum_alone():
    # a backdoor node scales what it sends (model replacement), never its own momentum: the
    # batched rows must follow the per-node rows round after round
    cfg = grid(load_scenario(None, TINY + ["model=mlp", "momentum=0.9"]))[0]
    fast, slow = (CellRun(Cell(cfg, "mean", "backdoor:gamma=3", 0), vectorize=v) for v in (True, False))
    for _ in range(3):  # the same round three times: the momenta accumulate
        assert torch.allclose(fast.rows(fast.ids), slow.rows(slow.ids), rtol=1e-4, atol=1e-6)


def test_a_diverged_model_does_not_stop_an_omniscient_attack_or_the_run():
    # lr 1e38 blows the model up at once: rows turn non-finite and are rejected before the
    # attack (which aggregates what it crafts) sees them; rounds without a valid row skip
    # their step and their scores, and the run goes on to its end
    for lr in ("1e30", "1e38"):
        cfg = grid(load_scenario(None, TINY + [f"lr={lr}", "model=mlp", "rounds=6"]))[0]
        for attack in ("optimal-alie", "alie"):
            record = run_cell(Cell(cfg, "mean", attack, 0))
            assert record["rejected"] > 0 and record["skipped_rounds"] > 0 and len(record["accuracy"]) == 6


@pytest.mark.parametrize("value, words", [
    ("rounds=0", "scenario: rounds must be an integer >= 1 (got rounds=0)"),
    ("batch-size=0", "scenario: batch-size must be an integer >= 1 (got batch-size=0)"),
    ("protocol=delta:steps=0", "scenario: protocol: delta: steps must be an integer in [1, 100000] (got steps=0)"),
    ("lr=[0.1, -1]", "scenario: lr must be a number > 0 (got lr=-1)"),
    ("quorum=9", "quorum=9 is above nodes=7: no round could step; lower quorum"),
])
def test_bad_scenario_values_are_one_line_errors(tmp_path, value, words):
    done = bench(tmp_path / "x", "--set", value)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"robust bench: error: {words}"


@pytest.mark.parametrize("aggregator", ["krum", "multi-krum", "bulyan", "mda"])
def test_selecting_rules_quarantine_no_honest_node_in_20_rounds(aggregator):
    cfg = grid(load_scenario(None, TINY + ["rounds=20", "byzantine=1"]))[0]
    record = run_cell(Cell(cfg, aggregator, "none", 0))
    assert record["false_quarantines"] == 0 and record["skipped_rounds"] == 0
    assert list(record["rounds_to_quarantine"].values()) == [None]  # nor the node that is Byzantine but honest
    assert record["final_accuracy"] > record["accuracy"][0]


def engine_with(threat, features=4):
    from nodes.engine.engine import Engine
    from nodes.settings import Settings
    from robust.models import build_model

    return Engine(Settings(aggregator="krum", tolerate=1), build_model("logreg", (features,), 3),
                  torch.zeros(2, features), torch.zeros(2, dtype=torch.int64), threat)


def test_the_threat_hook_plays_only_in_a_round_that_steps():
    # krum with f=1 serves 5 rows; 3 of 6 rows are non-finite: a search attack run on the
    # 3 left would ask krum for 3 rows. The round must skip, and not crash.
    from evaluation.bench.threat import ThreatModel

    ids = [f"{i:064x}" for i in range(6)]
    threat = ThreatModel("optimal-alie", {ids[0]}, seed=0)
    engine = engine_with(threat)
    X = torch.randn(6, engine.w.numel(), generator=torch.Generator().manual_seed(0))
    X[3:] = float("nan")
    record = engine.step(ids, ids, X)
    assert record["skipped"] == "3 valid rows, quorum is 5: no step" and len(record["rejected"]) == 3
    assert threat.coalitions == {} and engine.round == 1


def test_a_partly_quarantined_coalition_crafts_for_the_colluders_left():
    import attacks
    from evaluation.bench.threat import ThreatModel
    from robust.seeds import generator

    ids = ["a", "b", "c", "d", "e"]
    threat = ThreatModel("alie", {"a", "x"}, seed=3)  # "x" was quarantined: one colluder left
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    out = threat.rows(engine_with(threat), 4, ids, X)
    ctx = attacks.Context(n=5, generator=generator(3, 4, "attack"), own=X[:1], round=4)
    assert list(threat.coalitions) == [1] and torch.equal(out[0], attacks.build("alie", 1)(X[1:], ctx)[0])
    assert torch.equal(out[1:], X[1:])


class Crafting:
    """A threat hook that hands back the rows it was given, or new ones with a NaN row."""

    def __init__(self, craft: bool) -> None:
        self.craft = craft

    def rows(self, engine, round, ids, X):
        if not self.craft:
            return X
        X = X.clone()
        X[0] = float("nan")
        return X

    def observe(self, ids, X, aggregate):
        pass


@pytest.mark.parametrize("craft", [False, True])
def test_rows_the_hook_crafts_are_screened_again_and_its_own_rows_once(craft, monkeypatch):
    from nodes.engine import engine as module

    screened = []
    real = module.rejected_rows
    monkeypatch.setattr(module, "rejected_rows", lambda X, bound: screened.append(X.n) or real(X, bound))
    ids = [f"{i:064x}" for i in range(6)]
    engine = engine_with(Crafting(craft))
    record = engine.step(ids, ids, torch.randn(6, engine.w.numel(), generator=torch.Generator().manual_seed(2)))
    assert screened == ([6, 6] if craft else [6])
    assert record["rejected"] == ({ids[0]: "non-finite values"} if craft else {}) and not record["skipped"]


def test_a_cell_process_keeps_its_freed_memory_for_reuse():
    import platform

    from robust.allocator import reuse_freed_memory

    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert reuse_freed_memory() is glibc  # glibc's mallopt took both thresholds
