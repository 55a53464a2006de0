"""The bench report: numbers in summary.md checked against hand-computed values, the PNGs,
and the reading of a results.jsonl cut short by a killed run."""

import json
import math

import pytest

from evaluation.reports.summary import read_results, validation_detect_round, write_report, write_summary

NAN = math.nan
CONFIG = {"dataset": "mnist1d", "partition": "dirichlet", "alpha": 0.3, "model": "mlp",
          "nodes": 10, "byzantine": 2, "rounds": 4, "batch-size": 32, "lr": 0.1}

# (aggregator, attack) -> per seed: accuracy curve (its last value is the final accuracy),
# {detector: (auc, tpr_at_5fpr, rounds_to_detect)}, kappa_max.
CLEAN_SCORES = {"norm": (NAN, 0.0, None), "krum-score": (NAN, 0.0, None)}
GRID = {
    ("mean", "none"): [([.3, .5, .7, .90], CLEAN_SCORES, 0.5), ([.4, .6, .8, .92], CLEAN_SCORES, 0.5)],
    ("mean", "alie"): [([.35, .52, .5, .5], {"norm": (.5, .1, None), "krum-score": (.9, .5, 3)}, 1.0),
                       ([.35, .58, .6, .6], {"norm": (.6, .1, None), "krum-score": (.9, .7, 5)}, 2.0)],
    ("mean", "ipm"): [([.3, .5, .7, .70], {"norm": (.99, 1., 1), "krum-score": (.5, 0., None)}, 5.0),
                      ([.4, .6, .8, .80], {"norm": (.97, 1., 1), "krum-score": (.5, 0., None)}, 1.0)],
    ("krum", "none"): [([.3, .5, .7, .88], CLEAN_SCORES, 0.5), ([.4, .6, .8, .86], CLEAN_SCORES, 0.5)],
    ("krum", "alie"): [([.3, .5, .7, .80], {"norm": (.7, .1, None), "krum-score": (.8, .6, None)}, 1.5),
                       ([.4, .6, .8, .78], {"norm": (.8, .1, None), "krum-score": (.8, .6, 4)}, 3.0)],
    ("krum", "ipm"): [([.5, .6, .6, .60], {"norm": (NAN, 1., 1), "krum-score": (.5, 0., None)}, 1.0),
                      ([.5, .6, .6, .62], {"norm": (.98, .8, 2), "krum-score": (.5, 0., None)}, 1.0)],
}
# (attack, param, value, aggregator) -> final accuracy, norm AUC (one seed each).
SWEEP = {
    ("alie", "z", 0.5, "krum"): (.85, .55), ("alie", "z", 0.5, "mean"): (.87, .55),
    ("alie", "z", 1.0, "krum"): (.80, .60), ("alie", "z", 1.0, "mean"): (.81, .60),
    ("alie", "z", 2.0, "krum"): (.60, .90), ("alie", "z", 2.0, "mean"): (.50, .90),
    ("ipm", "epsilon", 0.1, "krum"): (.70, .90),
}


def record(aggregator, attack, seed, curve, scores, kappa_max, config=CONFIG, sweep=None):
    """One results.jsonl record, as the engine writes it."""
    return {
        "cell": f"{aggregator}|{attack}|{seed}|{json.dumps(config, sort_keys=True)}",
        "aggregator": aggregator, "attack": attack, "seed": seed, "config": config,
        "sweep": sweep, "final_accuracy": curve[-1], "accuracy": curve,
        "detect": {name: {"auc": auc, "tpr_at_5fpr": tpr, "rounds_to_detect": rounds}
                   for name, (auc, tpr, rounds) in scores.items()},
        "kappa": [kappa_max] * len(curve), "kappa_max": kappa_max, "kappa_bound": 4.0,
        "backdoor_asr": None, "model_sha256": "0" * 64, "wall_time": 1.0, "node_steps_per_s": 100.0,
    }


def grid_records():
    return [record(agg, attack, seed, *cell)
            for (agg, attack), seeds in GRID.items() for seed, cell in enumerate(seeds)]


def sweep_records():
    return [record(agg, f"{attack}:{param}={value}", 0, [.3, .5, .7, final],
                   {"norm": (auc, .5, 2)}, 1.0,
                   sweep={"attack": attack, "param": param, "value": value})
            for (attack, param, value, agg), (final, auc) in SWEEP.items()]


def write_jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    results = write_jsonl(out / "results.jsonl", grid_records() + sweep_records())
    paths = write_report(results, out)
    return paths, paths[0].read_text()


def test_scenario_lists_the_shared_config_and_the_cell_counts(report):
    _, summary = report
    assert "dataset=mnist1d, partition=dirichlet, alpha=0.3, model=mlp, nodes=10" in summary
    assert "- grid: 12 cells (2 aggregators x 3 attacks x 2 seeds); sweeps: 7 cells" in summary
    assert "varying" not in summary


def test_accuracy_table_is_mean_over_seeds_sorted_by_worst_case(report):
    _, summary = report
    header = "| aggregator | none | alie | ipm | worst case | worst attack |"
    krum = "| krum | 87.0 (86.0) | 79.0 (78.0) | 61.0 (60.0) | 61.0 | ipm |"
    mean = "| mean | 91.0 (90.0) | 55.0 (50.0) | 75.0 (70.0) | 55.0 | alie |"
    # krum is cleaner-worse but worst-case-better: it comes first.
    assert summary.index(header) < summary.index(krum) < summary.index(mean)


def test_detectability_rows(report):
    _, summary = report
    # alie: damage mean(91-55, 87-79) = 22; krum-score AUC mean(.9,.9,.8,.8), rounds median
    # (3, 4, 5, never) = 4.5; validation detect (rounds from 0) median(mean: 2, krum: 3) = 2.5.
    assert "| alie | 22.0 | krum-score | 0.85 | 0.60 | 4.5 | 2.5 | 3.00 ≤ 4.00 |" in summary
    # ipm: damage mean(16, 26) = 21; norm AUC mean(.99, .97, .98) (NaN left out);
    # validation detect median(mean: 3, krum: 0) = 1.5; kappa 5 above bound 4.
    assert "| ipm | 21.0 | norm | 0.98 | 0.95 | 1 | 1.5 | 5.00 > 4.00 |" in summary
    assert "| none |" not in summary.split("## Detectability")[1]


def test_stealth_frontier_table_and_sentence(report):
    _, summary = report
    alie = summary.split("### alie")[1].split("###")[0]
    for row in ["| 0.5 | 3.0 | norm | 0.55 |", "| 1 | 8.5 | norm | 0.60 |",
                "| 2 | 34.0 | norm | 0.90 |"]:
        assert row in alie
    assert "largest damage with best-detector AUC <= 0.6: 8.5 pp at z=1" in alie
    assert "none stays below AUC 0.6" in summary.split("### ipm")[1]


def test_the_headline_is_the_harm_each_defence_lets_through_unseen(report, tmp_path):
    _, summary = report
    headline = summary.split("## Stealth frontier")[1].split("##")[0]
    # mean: only the sweep's alie z=0.5 (damage 91-87) and z=1 (91-81) keep AUC <= 0.6; krum: 87-80
    assert "| mean | 10.0 pp: alie:z=1.0, AUC 0.60 | — | — |" in headline
    assert "| krum | 7.0 pp: alie:z=1.0, AUC 0.60 | — | — |" in headline
    quiet = {"norm": (.5, .1, None)}
    records = [record("mean", "none", 0, [.5, .9], CLEAN_SCORES, 1.0),
               {**record("mean", "a", 0, [.5, .85], quiet, 1.0), "rounds_to_quarantine": {"x": None, "y": None}},
               {**record("mean", "b", 0, [.5, .81], quiet, 1.0), "rounds_to_quarantine": {"x": 7, "y": None}},
               {**record("mean", "c", 0, [.5, .70], {"norm": (.9, .1, 1)}, 1.0), "rounds_to_quarantine": {"x": None}}]
    for r in records:
        r.setdefault("rounds_to_quarantine", {})
        r.update(caught_round=None, false_quarantines=0)
    summary = write_summary(records, tmp_path).read_text()
    # largest with AUC <= 0.6: b (9 pp); never quarantined: c (20 pp, but seen); both: a (5 pp)
    assert "| mean | 9.0 pp: b, AUC 0.50 | 20.0 pp: c | 5.0 pp: a, AUC 0.50 |" in summary


def test_pngs_are_written_valid_and_linked(report):
    paths, summary = report
    assert [p.name for p in paths] == ["summary.md", "summary.html", "heatmap.png", "accuracy_curves.png",
                                       "damage_vs_detectability.png", "stealth_frontier.png"]
    for png in paths[2:]:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024, png
        assert f"]({png.name})" in summary


def test_validation_detect_round():
    clean = [[.1, .2, .3], [.2, .3, .4]]
    assert validation_detect_round([.1, .3, .5], clean) == 2  # band edges are inside
    assert validation_detect_round([.15, .1, .35], clean) == 1
    assert validation_detect_round([.3, .25, .35], clean) == 0
    assert validation_detect_round([.15, .25, .35, .9], clean) is None  # past the clean runs
    assert validation_detect_round([.9, .9], []) is None


def test_cells_cut_short_by_a_killed_run_are_skipped(tmp_path):
    records = grid_records()
    rerun = {**records[0], "final_accuracy": 0.5}
    text = json.dumps(records[1])
    cut = text[:text.index(', "kappa"')]  # ends with a whole nested object: the "detect" dict
    results = write_jsonl(tmp_path / "results.jsonl", records + [rerun], tail="\n" + cut)
    with pytest.warns(UserWarning, match="line 15: skipped a cell cut short"):
        read = read_results(results)
    assert sorted(r["cell"] for r in read) == sorted(r["cell"] for r in records)
    assert [r["final_accuracy"] for r in read if r["cell"] == rerun["cell"]] == [0.5]
    # A resumed run appended to the cut line: the whole record after the cut is kept.
    results.write_text(cut + "\n" + cut + json.dumps(records[2]) + "\n" + json.dumps(records[3]))
    with pytest.warns(UserWarning) as caught:
        assert [r["cell"] for r in read_results(results)] == [records[2]["cell"], records[3]["cell"]]
    assert [str(w.message).split("jsonl ")[1] for w in caught] == [
        "line 1: skipped a cell cut short by a killed run",
        "line 2: skipped a cell cut short by a killed run, kept the whole record after the cut",
    ]
    results.write_text(json.dumps({"cell": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1 lacks"):
        read_results(results)


def test_a_sweep_run_reports_clean_accuracy_and_the_frontier_only(tmp_path):
    clean = [r for r in grid_records() if r["attack"] == "none"]
    results = write_jsonl(tmp_path / "results.jsonl", clean + sweep_records())
    paths = write_report(results, tmp_path)
    summary = paths[0].read_text()
    assert "| krum | 87.0 (86.0) | — | — |" in summary
    assert "Detectability" not in summary and "Stealth frontier" in summary
    assert [p.name for p in paths[2:]] == ["heatmap.png", "accuracy_curves.png", "stealth_frontier.png"]


def test_varying_scenario_keys_label_the_rows(tmp_path):
    records = [
        record("mean", attack, 0, [.5, final], {"norm": (auc, .5, 1)}, 1.0, {**CONFIG, "alpha": alpha})
        for alpha, attack, final, auc in [(0.1, "none", .8, NAN), (0.1, "alie", .6, .7),
                                          (1.0, "none", .9, NAN), (1.0, "alie", .6, .7)]
    ]
    summary = write_summary(records, tmp_path).read_text()
    assert "- varying alpha: 0.1, 1.0" in summary
    assert "| mean (alpha=1.0) | 90.0 | 60.0 | 60.0 | alie |" in summary
    assert "| alie (alpha=0.1) | 20.0 |" in summary and "| alie (alpha=1.0) | 30.0 |" in summary


def test_quarantine_table_by_hand(tmp_path):
    quarantine = {  # (attack, seed) -> rounds_to_quarantine, caught_round, false_quarantines
        ("none", 0): ({"a": None, "b": None}, None, 0), ("none", 1): ({"a": None, "b": None}, None, 0),
        ("ipm", 0): ({"a": 1, "b": 2}, 2, 0), ("ipm", 1): ({"a": 1, "b": None}, None, 1),
    }
    records = []
    for (aggregator, attack), seeds in GRID.items():
        if aggregator != "mean" or attack == "alie":
            continue
        for seed, cell in enumerate(seeds):
            to_quarantine, caught, false = quarantine[attack, seed]
            records.append(record(aggregator, attack, seed, *cell) | {
                "rounds_to_quarantine": to_quarantine, "caught_round": caught, "false_quarantines": false})
    summary = write_summary(records, tmp_path).read_text()
    section = summary.split("## Quarantine")[1]
    assert "over all 4 cells: **1**" in section
    # caught 2 and 1 of 2; by rounds 2 and never -> median never; damage: clean curve (mean of
    # the none seeds) minus attacked at the round caught (2: .75 - .70) or at the end (3: .91 - .80)
    assert "| ipm | mean | 1.5/2 | never | 8.0 | 0.5 |" in section
    assert "| none | mean | — | — | — | 0 |" in section


def test_the_summary_leads_with_the_frontier_and_the_worst_cases(report):
    _, summary = report
    heads = [line for line in summary.splitlines() if line.startswith("## ")]
    assert heads[:3] == ["## Stealth frontier", "## Worst cases", "## Scenario"]
    worst = summary.split("## Worst cases")[1].split("\n## ")[0]
    # krum's worst: ipm, 61.0 (60.0), clean 87.0; mean's: alie, 55.0 (50.0), clean 91.0; best AUC
    # of krum/ipm: norm mean(.98) (NaN left out); mean/alie: krum-score .9
    assert worst.index("| krum | ipm | 61.0 (60.0) | 26.0 | 0.98 | — |") < worst.index(
        "| mean | alie | 55.0 (50.0) | 36.0 | 0.90 | — |")


def big_grid(defences, attacks):
    """A grid of ``defences`` x ``attacks`` (``none`` first), one seed, made-up accuracies."""
    return [record(agg, attack, 0, [.3, .9 - .01 * i - .02 * j], CLEAN_SCORES if attack == "none" else
                   {"norm": (.5 + .01 * j, .1, None)}, 1.0)
            for i, agg in enumerate(defences) for j, attack in enumerate(["none", *attacks])]


def test_a_big_grid_is_split_by_family_into_readable_pages(tmp_path):
    attacks = [f"{family}:k={k}" for family in ("min-max", "drift", "poisoned-fl") for k in range(5)]  # 15
    defences = ["mean", "trimmed-mean", "nnm+trimmed-mean", "krum"]
    paths = write_report(write_jsonl(tmp_path / "results.jsonl", big_grid(defences, attacks)), tmp_path)
    names = [p.name for p in paths]
    # 15 attacks, 11 to a page with none: min-max and drift whole on page 1, poisoned-fl on page 2
    for plot in ("heatmap", "accuracy_curves", "damage_vs_detectability"):
        assert [n for n in names if n.startswith(plot)] == [f"{plot}-1.png", f"{plot}-2.png"]
    summary = paths[0].read_text()
    accuracy = summary.split("## Accuracy")[1].split("\n## ")[0]
    first, second = accuracy.split("### Page 1 of 2: attacks min-max, drift; defences mean, trimmed-mean, krum")[1] \
        .split("### Page 2 of 2: attacks poisoned-fl; defences mean, trimmed-mean, krum")
    headers = [next(line for line in part.splitlines() if line.startswith("| aggregator |")) for part in (first, second)]
    assert headers[0].startswith("| aggregator | none | min-max:k=0 |") and "poisoned-fl" not in headers[0]
    assert headers[1].startswith("| aggregator | none | poisoned-fl:k=0 | poisoned-fl:k=1 |") and "drift" not in headers[1]
    for part in (first, second):  # every defence on every page, its worst case over the whole grid
        assert part.count("| nnm+trimmed-mean |") == 1 and "| poisoned-fl:k=4 |" in part


def test_pages_keep_families_whole_and_bound_their_size():
    from evaluation.reports.paging import attack_family, defence_family, pages

    items = ["a:1", "a:2", "b:1", "c:1", "c:2", "c:3", "d:1"]
    assert pages(items, attack_family, limit=3) == [["a:1", "a:2", "b:1"], ["c:1", "c:2", "c:3"], ["d:1"]]
    assert pages(["x:1", "x:2", "x:3", "x:4", "y:1"], attack_family, limit=3) == [["x:1", "x:2", "x:3"], ["x:4", "y:1"]]
    assert pages(items, attack_family, limit=12) == [items]
    assert defence_family("bucketing:s=2+centered-clipping:tau=10") == "centered-clipping"
    assert defence_family("krum") == "krum"


def test_the_report_is_also_one_self_contained_page(report):
    paths, summary = report
    page = paths[1].read_text()
    assert page.startswith("<!doctype html>") and "<title>robust bench report</title>" in page
    # every table of the summary, row for row; every figure embedded, none linked
    assert page.count("<table>") == sum(1 for i, line in enumerate(summary.splitlines())
                                        if line.startswith("| ") and not summary.splitlines()[i - 1].startswith("|"))
    assert page.count('src="data:image/png;base64,') == len(paths) - 2 and ".png)" not in page
    row = next(line for line in summary.splitlines() if line.startswith("| krum |"))
    assert "<tr>" + "".join(f"<td>{cell}</td>" for cell in row.strip("| ").split(" | ")) + "</tr>" in page


def test_the_page_escapes_every_value(tmp_path):
    from evaluation.reports.html_page import to_html

    markdown = ("# report\n\nA `code <b>` span and **bold & more**.\n\n| defence | attack |\n| --- | --- |\n"
                "| <script>alert(1)</script> | a&b |\n\n- item <i>\n\n![missing](gone.png)\n")
    page = to_html(markdown, tmp_path)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a&amp;b" in page
    assert "<code>code &lt;b&gt;</code>" in page and "<strong>bold &amp; more</strong>" in page
    assert "<li>item &lt;i&gt;</li>" in page and "figure gone.png is not beside the report" in page


def test_a_text_grid_is_ranked_by_held_out_loss_lower_is_better(tmp_path):
    """Language models (``evaluation.reports.objective``): the worst case is the highest loss, the
    damage is attacked minus clean loss, and time to target is the first round at or below the
    bar (the best clean final loss / target)."""
    config = {**CONFIG, "dataset": "pystdlib", "model": "gpt-tiny"}
    losses = {("mean", "none"): [4.0, 3.0, 2.5], ("mean", "alie"): [4.0, 3.5, 3.1],
              ("mean", "ipm"): [4.0, 3.2, 2.7], ("krum", "none"): [4.0, 3.1, 2.6], ("krum", "alie"): [4.0, 3.3, 2.9]}
    records = []
    for (agg, attack), curve in losses.items():
        r = record(agg, attack, 0, [0.35] * 3, CLEAN_SCORES if attack == "none" else {"norm": (.5, .1, None)}, 1.0,
                   config=config)
        records.append({**r, "loss": curve, "final_loss": curve[-1]})
    text = write_summary(records, tmp_path).read_text()
    assert "## Held-out loss" in text and "Final held-out loss (nats per byte)" in text
    assert "| mean | alie | 3.100 (3.100) | 0.600 |" in text  # the highest loss; 3.1 - 2.5 nats
    assert "| krum | 2.600 | 2.900 | — | 2.900 | alie |" in text and "| mean | 0.600 nats: alie, AUC 0.50 |" in text
    from evaluation.reports.results import Results

    res = Results(records)
    assert res.metric.name == "held-out loss"
    bar = {r["attack"] + r["aggregator"]: (r["target_bar"], r["round_to_target"]) for r in res.records}
    assert bar["nonemean"] == (2.5 / 0.95, 2) and bar["ipmmean"] == (2.5 / 0.95, None)


def test_a_timed_text_grid_reports_time_to_target_by_held_out_loss(tmp_path):
    from evaluation.reports.time_section import time_section
    from evaluation.reports.results import Results

    config = {**CONFIG, "dataset": "pystdlib", "model": "gpt-tiny", "speed": "slow:fraction=0.2,factor=10"}
    records = []
    for attack, curve in (("none", [4.0, 2.6, 2.5]), ("alie", [4.0, 3.5, 2.7])):
        r = record("mean", attack, 0, [0.35] * 3, CLEAN_SCORES if attack == "none" else {"norm": (.5, .1, None)}, 1.0,
                   config=config)
        records.append({**r, "loss": curve, "final_loss": curve[-1], "times": [10.0, 20.0, 30.0], "sim_seconds": 30.0,
                        "bytes": [1e6, 2e6, 3e6], "bytes_down_by_round": [1e6, 2e6, 3e6], "bytes_up": 3e6,
                        "bytes_down": 3e6, "false_quarantines": 0})
    lines = "\n".join(time_section(Results(records)))
    assert "held-out loss falls to the best clean final loss" in lines and "held-out loss (nats/byte)" in lines
    assert "| mean | none | — | 2.500 | 30.00 | 20.00 |" in lines  # 2.6 <= 2.5 / 0.95 = 2.63 first at round 1 (20 s)
    assert "| mean | alie | — | 2.700 | 30.00 | never |" in lines  # 2.7 never is
