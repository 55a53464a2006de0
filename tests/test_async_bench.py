"""Simulated time in the bench: synchronous rounds on a clock, buffered asynchronous rounds
(FedBuff) through the one engine, compressed replies, churn, and their report."""

import math
import signal

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.scenario import grid, load_scenario
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from evaluation.reports.summary import Results
from evaluation.reports.target_costs import bars, task
from evaluation.reports.time_section import time_section
from nodes.engine.ledger import Ticket
from nodes.engine.staleness import weight_of
from nodes.settings import Settings

BASE = {"dataset": "digits", "model": "mlp", "nodes": 10, "byzantine": 2, "rounds": 6, "partition": "iid",
        "alpha": 1.0, "protocol": "momentum", "step-seconds": 0.01}
SLOW = "slow:fraction=0.2,factor=10"


def test_staleness_weights_and_their_errors():
    assert weight_of("constant")(7) == 1.0
    assert weight_of("sqrt")(3) == 0.5
    assert weight_of("poly:a=1")(3) == 0.25
    for bad, message in [("linear", "write constant, sqrt or poly"),
                         ("sqrt:a=1", "sqrt: unknown key a \\(known: none\\)"),
                         ("poly:a=-1", "a must be a number in")]:
        with pytest.raises(ValueError, match=message):
            weight_of(bad)
    with pytest.raises(ValueError, match="buffer=3 is below what the aggregator needs"):
        Settings(aggregator="trimmed-mean", tolerate=2, round="async", buffer=3)


def test_the_engine_weighs_rows_by_staleness_and_rejects_the_stale():
    settings = Settings(aggregator="mean", tolerate=0, round="async", staleness="sqrt", max_staleness=4,
                        dataset="digits", model="mlp")
    run = CellRun(Cell({**BASE, "byzantine": 0}, "mean", "none", 0))
    run.engine.settings = settings
    run.engine.weight = weight_of(settings.staleness)
    ids = run.ids[:3]
    X = torch.ones(3, run.engine.w.numel())
    w = run.engine.w.clone()
    tasks = {i: Ticket(i, 1, -tau, "base", None) for i, tau in zip(ids, (0, 3, 5))}  # version -tau: tau behind
    record = run.engine.step(ids, ids, X, tasks=tasks)
    assert record["staleness"] == {ids[0]: 0, ids[1]: 3}
    assert record["rejected"] == {ids[2]: "stale: 5 versions behind, max-staleness is 4"}
    # mean of 1 and 1/sqrt(4), one momentum step of lr 0.05 from w
    assert torch.allclose(run.engine.w, w - 0.05 * 0.75)
    assert torch.equal(X, torch.ones(3, run.engine.w.numel()))  # the caller's rows untouched


def test_per_node_links_are_one_scenario_and_a_round_waits_for_the_slowest_link():
    one = "home:up_mbps=1,down_mbps=100,latency_ms=0"
    scenario = load_scenario(None, ["nodes=4", "byzantine=1", f'link=["{one}", "lan"]'])
    assert len(grid(scenario)) == 1 and scenario["link"] == [one, "lan"]
    assert len(grid(load_scenario(None, ["nodes=4", "byzantine=1", f'link=[["{one}", "lan"], ["lan"]]']))) == 2
    short = {**BASE, "rounds": 2}
    mixed = run_cell(Cell({**short, "link": ["lan", one]}, "mean", "none", 0))
    slow = run_cell(Cell({**short, "link": one}, "mean", "none", 0))
    fast = run_cell(Cell({**short, "link": "lan"}, "mean", "none", 0))
    assert mixed["times"] == pytest.approx(slow["times"], rel=1e-3)  # every round waits for a 1 Mbit/s uplink
    assert fast["times"][-1] < mixed["times"][-1] / 5
    assert mixed["model_sha256"] == slow["model_sha256"] == fast["model_sha256"]


def test_synchronous_rounds_on_the_clock_wait_for_the_slowest_or_the_deadline():
    fast = run_cell(Cell(BASE, "trimmed-mean", "none", 0))
    assert math.isclose(fast["sim_seconds"], 6 * 0.01) and fast["times"][0] == pytest.approx(0.01)
    assert fast["bytes_up"] == 6 * 10 * 4 * len(CellRun(Cell(BASE, "trimmed-mean", "none", 0)).engine.w)
    slow = run_cell(Cell({**BASE, "speed": SLOW}, "trimmed-mean", "none", 0))
    assert math.isclose(slow["sim_seconds"], 6 * 0.1) and slow["model_sha256"] == fast["model_sha256"]
    run = CellRun(Cell({**BASE, "speed": SLOW, "deadline": 0.05}, "trimmed-mean", "none", 0))
    record = run.play_round()
    late = record["failed"]
    assert len(late) == 2 and all(reason.startswith("late: arrived 0.1 s") for reason in late.values())
    assert record["accepted"] == 8 and record["time"] == pytest.approx(0.05)


def test_asynchronous_rounds_keep_fast_nodes_busy_and_give_the_same_bits():
    cell = Cell({**BASE, "speed": SLOW, "round": "async", "rounds": 3}, "trimmed-mean", "alie", 0)
    run = CellRun(cell)
    assert run.engine.settings.rounds == 3 * math.ceil(10 / 5)  # buffers of 5: as many replies as sync
    records = [run.play_round() for _ in range(run.engine.settings.rounds)]
    assert all(len(r["ids"]) == len(set(r["ids"])) == 5 for r in records)
    assert any(tau > 0 for r in records for tau in r["staleness"].values())
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[-1] < 3 * 0.1  # sync waiting for the slow nodes: 0.1 s a round
    again = run_cell(cell)
    assert again["model_sha256"] == records[-1]["model_sha256"] and again["times"] == times


def test_compressed_replies_cost_fewer_bytes_and_crafted_rows_travel_encoded():
    plain = run_cell(Cell(BASE, "trimmed-mean", "alie", 0))
    int8 = run_cell(Cell({**BASE, "compression": "int8"}, "trimmed-mean", "alie", 0))
    topk = run_cell(Cell({**BASE, "compression": "topk:k=0.01"}, "trimmed-mean", "alie", 0))
    assert plain["bytes_up"] / int8["bytes_up"] >= 3.9 and plain["bytes_up"] / topk["bytes_up"] >= 20
    assert int8["bytes_down"] == plain["bytes_down"]
    assert int8["model_sha256"] != plain["model_sha256"]
    run = CellRun(Cell({**BASE, "compression": "topk:k=0.01"}, "trimmed-mean", "alie", 0))
    X = torch.randn(len(run.ids), run.engine.w.numel())
    crafted = run.threat.rows(run.engine, 1, run.ids, X)
    byz = run.threat._mask(run.ids)
    kept = run.timeline.codec.count(X.shape[1])
    assert all(int((row != 0).sum()) <= kept for row in crafted[byz])


def test_a_shared_support_keeps_every_row_of_a_round_on_its_tasks_coordinates():
    """shared-sign in the bench: the honest rows and the crafted ones of a round decode on the
    one support the round's task announced; the next round's is another; ~99x fewer bytes up."""
    plain = run_cell(Cell(BASE, "trimmed-mean", "alie", 0))
    shared = run_cell(Cell({**BASE, "compression": "shared-sign"}, "trimmed-mean", "alie", 0))
    assert plain["bytes_up"] / shared["bytes_up"] > 90
    run = CellRun(Cell({**BASE, "compression": "shared-sign"}, "trimmed-mean", "alie", 0))
    seen, observe = [], run.threat.observe
    run.threat.observe = lambda ids, X, aggregate: (seen.append((ids, X.clone())), observe(ids, X, aggregate))
    for _ in range(2):
        run.play_round()
    d = run.engine.w.numel()
    for ids, X in seen:
        sent = X != 0
        assert run.setup.byzantine & set(ids) and (sent == sent[0]).all() and int(sent[0].sum()) == math.ceil(d / 4)
    assert not torch.equal(seen[0][1][0] != 0, seen[1][1][0] != 0)


def test_churn_leaves_nodes_out_and_runs_still_finish():
    churn = {**BASE, "churn": "leave:p=0.3,back=0.3", "rounds": 8}
    run = CellRun(Cell(churn, "trimmed-mean", "none", 0))
    asked = [run.play_round()["asked"] for _ in range(8)]
    assert min(asked) < 10
    assert run_cell(Cell({**churn, "round": "async"}, "trimmed-mean", "none", 0))["final_accuracy"] > 0.5


def test_the_report_gives_time_to_target_against_the_best_clean_run():
    records = [run_cell(Cell({**BASE, "speed": SLOW, "round": mode}, "trimmed-mean", attack, 0))
               for mode in ("sync", "async") for attack in ("none", "sign-flip")]
    best = bars(records)
    assert best == {task(records[0]): max(r["final_accuracy"] for r in records if r["attack"] == "none")}
    completed = Results(records).records
    assert any(r["time_to_target"] is not None for r in completed)
    for r in completed:
        if r["time_to_target"] is not None:
            first = next(i for i, a in enumerate(r["accuracy"]) if a >= 0.95 * best[task(r)])
            assert r["time_to_target"] == r["times"][first] and r["round_to_target"] == first
    lines = "\n".join(time_section(Results(records)))
    assert "## Time and bytes" in lines and "round=async" in lines and "round=sync" in lines
    assert time_section(Results([run_cell(Cell(BASE, "trimmed-mean", "none", 0))])) == []


def test_lookahead_sends_the_model_extrapolated_by_the_expected_staleness_and_resumes_to_the_same_bits():
    sync = CellRun(Cell({**BASE, "lookahead": True}, "trimmed-mean", "none", 0))
    assert sync.engine.lookahead is None and "task_sha256" not in sync.play_round()  # sync tasks are never stale
    cell = Cell({**BASE, "speed": SLOW, "round": "async", "rounds": 3, "lookahead": True}, "trimmed-mean", "none", 0)
    run = CellRun(cell)
    records = [run.play_round() for _ in range(4)]
    engine = run.engine
    la = engine.lookahead
    w, base = engine.task_model()
    assert la.tau == sum(records[-1]["staleness"].values()) / len(records[-1]["staleness"]) > 0
    assert torch.equal(w, engine.w + la.tau * la.velocity) and records[-1]["task_sha256"] == base != engine.base
    twin = CellRun(cell)  # a resumed engine: the same extrapolation, to the bit
    twin.engine.load_state(engine.state())
    assert twin.engine.task_model()[1] == base
    plain = run_cell(Cell({**BASE, "speed": SLOW, "round": "async", "rounds": 3, "lookahead": False}, "trimmed-mean",
                          "none", 0))
    ahead = run_cell(cell)
    assert ahead["model_sha256"] == run_cell(cell)["model_sha256"] != plain["model_sha256"]


def test_an_fp16_downlink_halves_the_bytes_down_and_nodes_train_from_the_rounded_model():
    plain = run_cell(Cell(BASE, "trimmed-mean", "alie", 0))
    run = CellRun(Cell({**BASE, "downlink": "fp16"}, "trimmed-mean", "alie", 0))
    w, base = run.engine.task_model()
    assert torch.equal(w, run.engine.w.half().float()) and base != run.engine.base
    half = run_cell(Cell({**BASE, "downlink": "fp16"}, "trimmed-mean", "alie", 0))
    assert plain["bytes_down"] == 2 * half["bytes_down"] and plain["bytes_up"] == half["bytes_up"]
    assert half["model_sha256"] != plain["model_sha256"] and abs(half["final_accuracy"] - plain["final_accuracy"]) < 0.05


def test_late_replies_carried_count_in_the_round_they_arrive_in_with_their_staleness():
    cell = Cell({**BASE, "speed": SLOW, "deadline": 0.05, "late": "carry", "rounds": 8}, "trimmed-mean", "none", 0)
    run = CellRun(cell)
    records = [run.play_round() for _ in range(8)]
    first = records[0]
    slow = sorted(first["failed"])
    assert len(slow) == 2 and all(r.endswith("carried to the round it arrives in") for r in first["failed"].values())
    assert first["staleness"] == dict.fromkeys(first["ids"], 0) and first["accepted"] == 8
    # a slow node's reply takes 0.1 s; later rounds wait only for the fast nodes (0.01 s): the slow
    # ones, busy (not asked), count in the first round that ends after 0.1 s, with its staleness
    back = next(r for r in records if set(slow) <= set(r["ids"]))
    before = records[1:back["round"] - 1]
    assert before and all(r["asked"] == 8 and not set(slow) & set(r["ids"]) for r in before)
    assert back["time"] >= 0.1 > records[back["round"] - 2]["time"]
    assert {i: back["staleness"][i] for i in slow} == dict.fromkeys(slow, back["round"] - 1) and back["accepted"] == 10
    dropped = CellRun(Cell({**BASE, "speed": SLOW, "deadline": 0.05, "rounds": 4}, "trimmed-mean", "none", 0))
    assert all(r["accepted"] == 8 and "staleness" not in r for r in (dropped.play_round() for _ in range(3)))
    assert run_cell(cell)["model_sha256"] == run_cell(cell)["model_sha256"]


def test_an_async_buffer_leaves_once_every_node_that_can_still_answer_is_in_it():
    # three fast nodes leave for good at t = 0.15; the slow ones' replies are all too stale to
    # count (max-staleness 1), so no buffer can fill with valid replies: it leaves once every
    # node still answering is in it, and the run ends instead of waiting for the gone ones. A
    # deadline of 1 s gives a gone node's task up at 31 s (the default's, 90 s: thrice the replies)
    cfg = {**BASE, "nodes": 6, "byzantine": 0, "rounds": 40, "round": "async", "buffer": 3,
           "speed": "slow:fraction=0.5,factor=10", "max-staleness": 1, "deadline": 1.0}
    run = CellRun(Cell(cfg, "mean", "none", 0))
    v, line = run.timeline.volunteers, run.timeline
    fast = {n for n in run.ids if v.arrival(n, 0.0, line.steps, line.step_seconds, 0, 0) < 0.05}
    assert len(fast) == 3
    v.online_at = lambda node, t: node not in fast or t < 0.15
    v.leaves_during = lambda node, start, end: node in fast and end >= 0.15
    v.back_at = lambda node, t: float("inf")
    records = []

    def stuck(*_):
        raise AssertionError(f"play_round never returned: {len(run.loop.buffers.held)} replies held")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)  # each call ends (it once never did)
    try:
        while (record := run.play_round()) is not None:
            records.append(record)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(records) == run.engine.settings.rounds and len(run.loop.buffers.held) < 10
    assert any(r["rejected"] and not r["accepted"] for r in records)  # buffers of stale replies only, left anyway
