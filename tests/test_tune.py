"""``robust bench --tune`` (``evaluation.bench.tune``): candidates from the declared ranges, the
worst case over attacks, the budget, and the grid played on fresh seeds with the choice."""

import json
import subprocess
import sys

import pytest

import aggregators
from aggregators.base import REGISTRY
from evaluation.bench import tune
from evaluation.bench.scenario import cells, load_scenario
from robust.constraints import Interval


def test_every_tuned_parameter_is_a_number_with_a_range_and_a_default():
    tuned = {(name, key): p for name in REGISTRY.names() for key, p in REGISTRY.lookup(name, name).declared().items()
             if p.tune}
    assert {("bucketing", "s"), ("centered-clipping", "tau"), ("centered-clipping", "iters"), ("clip", "c")} <= set(tuned)
    for (name, key), p in tuned.items():
        assert isinstance(p.rule, Interval) and p.default is not None and p.rule.accepts(p.default), (name, key)


def test_candidates_start_with_the_spec_as_written_and_stay_within_the_declared_rules():
    assert tune.candidates("mean", 25, 5) == [("mean", 5)]  # nothing to tune: f only bounds the rows it serves
    assert tune.candidates("trimmed-mean", 25, 5) == [("trimmed-mean", 5), ("trimmed-mean", 2), ("trimmed-mean", 10)]
    # m derives from the round, so only f moves: 1 x 1/2 rounds to 0, and 4 fails multi-krum's n > 2f + 2 at 7 rows
    assert tune.candidates("multi-krum", 7, 1) == [("multi-krum", 1), ("multi-krum", 0), ("multi-krum", 2)]
    alone = [spec for spec, _ in tune.candidates("centered-clipping", 25, 5)]  # tau 10 x (1/4 .. 4), iters 1 x (1, 2, 4)
    assert alone[0] == "centered-clipping" and len(alone) == 15 and "centered-clipping:tau=2.5,iters=4" in alone
    assert not any("iters=0" in c for c in alone)  # 1 x 0.5 rounds to 0, which iters refuses
    chain = [spec for spec, _ in tune.candidates("bucketing:s=2+centered-clipping:tau=10,iters=3", 25, 5)]
    assert chain[0] == "bucketing:s=2+centered-clipping:tau=10,iters=3" and len(chain) == 1 + 3 + 4 + 3  # 80 > 16: one at a time
    assert "bucketing:s=8+centered-clipping:tau=10,iters=3" in chain
    assert "bucketing:s=2+centered-clipping:tau=2.5,iters=3" in chain and "bucketing:s=4+centered-clipping:tau=2.5,iters=3" not in chain
    assert tune.candidates("clip:c=2+mean", 25, 5) == [("clip:c=2+mean", 5), ("clip:c=0.5+mean", 5), ("clip:c=1.0+mean", 5),
                                                       ("clip:c=4.0+mean", 5), ("clip:c=8.0+mean", 5)]
    bucketed = tune.candidates("bucketing:s=2+trimmed-mean", 25, 5)  # 13 buckets serve f <= 6
    assert ("bucketing:s=2+trimmed-mean", 10) not in bucketed and ("bucketing:s=1+trimmed-mean", 10) in bucketed
    for spec, f in bucketed + [(c, 5) for c in chain + alone]:
        aggregators.build(spec, f).check_n(25)


def test_the_choice_is_the_best_worst_case_and_ties_keep_the_spec_as_written():
    def cand(spec, **accuracy):
        return tune.Candidate(spec, 5, None, accuracy, True, 1.0, True)

    tried = [cand("a", none=0.9, alie=0.5), cand("b", none=0.8, alie=0.7), cand("c", none=0.95, alie=0.6),
             tune.Candidate("d", 5)]  # d never ran
    assert tune.choose(tried).spec == "b" and tried[1].worst_attack == "alie"
    assert tune.choose([cand("a", none=0.9, alie=0.5), cand("b", none=0.5, alie=0.9)]).spec == "a"
    losses = [tune.Candidate("a", 5, None, {"none": 2.5, "alie": 2.9}, False, 1.0, True),  # a text set: held-out loss
              tune.Candidate("b", 5, None, {"none": 2.6, "alie": 2.7}, False, 1.0, True)]
    assert tune.choose(losses).spec == "b" and losses[0].worst == 2.9 and losses[0].worst_attack == "alie"


def test_the_rules_share_the_budget_and_stop_before_a_candidate_that_would_pass_it(tmp_path):
    scenario = load_scenario(None, ["nodes=7", "byzantine=1", 'aggregators=["clip:c=2+mean", "mean", "foolsgold"]',
                                    'attacks=["none"]', "seeds=[0]"])
    now = [0.0]
    played = []

    def play(todo, results):  # each candidate "takes" 10 s; clip's accuracy grows with c
        played.append(todo[0].aggregator)
        now[0] += 10.0
        value = float(todo[0].aggregator.split("=")[1].split("+")[0]) if "=" in todo[0].aggregator else 1.0
        return [{"aggregator": cell.aggregator, "attack": cell.attack, "final_accuracy": value / 10,
                 "config": cell.config} for cell in todo]

    chosen = tune.tune(scenario, cells, play, tmp_path, seeds=2, budget=50.0, clock=lambda: now[0])
    # clip's share: 50 / 2 rules to tune = 25 s, so 2 candidates (a third: 20 + 10 > 25); the mean has
    # nothing to tune and plays nothing; foolsgold gets what is left, 30 s: 3 candidates
    assert played == ["clip:c=2+mean", "clip:c=0.5+mean", "foolsgold", "foolsgold:kappa=0.25", "foolsgold:kappa=0.5"]
    assert {rule: keys["aggregators"] for rule, keys in chosen.items()} == {
        "clip:c=2+mean": ["clip:c=2+mean"], "mean": ["mean"], "foolsgold": ["foolsgold"]}
    report = json.loads((tmp_path / "tune.json").read_text())
    ran = [c["ran"] for c in report["rules"]["clip:c=2+mean"]["candidates"]]
    assert ran == [True, True, False, False, False] and report["seeds"] == [1000, 1001]


def test_validation_seeds_and_a_budget_are_refused_where_they_cannot_be_used(tmp_path):
    scenario = load_scenario(None, ["seeds=[0, 1000]"])
    with pytest.raises(ValueError, match=r"the scenario's seeds \[1000\] are validation seeds of --tune"):
        tune.validation_seeds(scenario, 2)
    with pytest.raises(ValueError, match="--tune-budget must be > 0 seconds"):
        tune.tune(scenario, cells, None, tmp_path, 1, 0.0)


def test_bench_tune_chooses_on_validation_seeds_and_reports_on_the_scenarios(tmp_path):
    out = tmp_path / "tuned"
    cmd = [sys.executable, "-m", "robust.cli", "bench", "--out", str(out), "--tune", "--tune-seeds", "1"]
    for item in ("rounds=3", "nodes=7", "byzantine=2", "seeds=[0]", "dataset=digits", "model=mlp", "protocol=momentum",
                 'aggregators=["mean","clip:c=2+mean","trimmed-mean"]', 'attacks=["none","sign-flip"]'):
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "tune.json").read_text())
    for rule in ("clip:c=2+mean", "trimmed-mean"):
        tried = report["rules"][rule]["candidates"]
        best = max(tried, key=lambda c: c["worst"])["worst"]
        assert next(c["worst"] for c in tried if c["label"] == report["rules"][rule]["chosen"]) == best
    assert [c["label"] for c in report["rules"]["trimmed-mean"]["candidates"]] == [
        "trimmed-mean", "trimmed-mean (f=1)"]  # f: 2 x 1/2; 2 x 2 = 4 and 8 fail trimmed mean's n > 2f at 7 rows
    tuning = [json.loads(line) for line in (out / "tune" / "results.jsonl").read_text().splitlines()]
    assert {r["seed"] for r in tuning} == {1000} and len(tuning) == 2 * (5 + 2)  # 2 attacks x the candidates
    assert "mean" not in {r["aggregator"] for r in tuning}  # nothing to tune: no tuning cell
    grid = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["seed"] for r in grid} == {0} and len(grid) == 3 * 2
    for rule in ("clip:c=2+mean", "trimmed-mean"):
        label = report["rules"][rule]["chosen"]
        chosen = next(c for c in report["rules"][rule]["candidates"] if c["label"] == label)
        assert any(r["aggregator"] == chosen["spec"] and r["config"]["tolerate"] == chosen["tolerate"] for r in grid)
    summary = (out / "summary.md").read_text()
    assert "## Tuning" in summary and "(as written)" in summary and "**chosen**" in summary
    assert "`mean`: nothing to tune" in summary
