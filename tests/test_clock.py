"""The bench's simulated clock: volunteer traits from specs, times, churn, events, metrics."""

from __future__ import annotations

import math
import random
import re
import statistics

import pytest
import torch

from evaluation.simtime.arrivals import CLOCK, EventQueue, Traffic, Volunteers, measure_step_seconds
from evaluation.simtime.traits import build_churn, build_link, build_speed

IDS = [f"node{i:03d}" for i in range(50)]


# -- specs --------------------------------------------------------------------------------


def test_specs_build_with_their_parameters() -> None:
    slow = build_speed("slow:fraction=0.3,factor=4")
    assert (slow.name, slow.fraction, slow.factor) == ("slow", 0.3, 4.0)
    assert build_speed("lognormal").sigma == 1.0
    home = build_link("home:up_mbps=10,down_mbps=50,latency_ms=40")
    assert (home.up_mbps, home.down_mbps, home.latency_ms) == (10.0, 50.0, 40.0)
    assert build_link("home:latency_ms=80").up_mbps == 10.0  # the others keep their defaults
    assert math.isinf(build_link("none").up_mbps)
    leave = build_churn("leave:p=0.1,back=0.5,period=30")
    assert (leave.p, leave.back, leave.period) == (0.1, 0.5, 30.0)
    assert build_churn("none").p == 0


@pytest.mark.parametrize(("build", "spec", "message"), [
    (build_speed, "slow:fraction=1.5", "slow: fraction must be a number in [0, 1] (got fraction=1.5)"),
    (build_speed, "slow:factor=0.5", "slow: factor must be a number >= 1"),
    (build_speed, "lognormal:sigma=-1", "lognormal: sigma must be a number >= 0"),
    (build_speed, "fast", "unknown speed 'fast' in 'fast': choose from lognormal, slow, uniform"),
    (build_speed, "slow:speed=2", "slow: unknown key speed (known: factor, fraction)"),
    (build_speed, "slow:fraction=abc", "slow: fraction must be a number in [0, 1] (got fraction='abc')"),
    (build_speed, "uniform+slow", "a speed spec names one kind"),
    (build_link, "home:up_mbps=0", "home: up_mbps must be a number > 0"),
    (build_link, "lan:latency_ms=-1", "lan: latency_ms must be a number >= 0"),
    (build_link, "none:up_mbps=1", "none: unknown key up_mbps (known: none)"),
    (build_link, "dialup", "unknown link 'dialup' in 'dialup': choose from home, lan, none"),
    (build_churn, "leave:p=2", "leave: p must be a number in [0, 1]"),
    (build_churn, "leave:back=-0.1", "leave: back must be a number in [0, 1]"),
    (build_churn, "leave:period=0", "leave: period must be a number > 0"),
    (build_churn, "often", "unknown churn 'often' in 'often': choose from leave, none"),
])
def test_bad_specs_say_what_to_fix(build, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build(spec)


def test_clock_params_check_as_scenario_keys() -> None:
    assert CLOCK["speed"].check("slow:fraction=0.2,factor=10") == "slow:fraction=0.2,factor=10"
    assert CLOCK["step-seconds"].check(2) == 2.0
    with pytest.raises(ValueError, match=r"^speed: slow: fraction must be a number in \[0, 1\]"):
        CLOCK["speed"].check("slow:fraction=1.5")
    with pytest.raises(ValueError, match=r"^step-seconds must be a number >= 0 \(got step-seconds=-1\)"):
        CLOCK["step-seconds"].check(-1)


def test_volunteers_refuse_bad_inputs() -> None:
    with pytest.raises(ValueError, match="ids repeats a node"):
        Volunteers.of(["a", "a"], 0)
    with pytest.raises(ValueError, match="ids must be a non-empty list"):
        Volunteers.of([], 0)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        Volunteers.of(["a"], -1)
    v = Volunteers.of(["a"], 0)
    with pytest.raises(ValueError, match="unknown node 'b': not one of the 1 volunteers"):
        v.compute_seconds("b", 1, 1.0)
    with pytest.raises(ValueError, match=r"steps must be an integer >= 0 \(got 1.5\)"):
        v.compute_seconds("a", 1.5, 1.0)
    with pytest.raises(ValueError, match="step_seconds must be a finite number of seconds >= 0"):
        v.compute_seconds("a", 1, math.nan)
    with pytest.raises(ValueError, match="bytes_up must be an integer >= 0"):
        v.upload_seconds("a", -1)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        v.online("a", -1)
    with pytest.raises(ValueError, match="end must not be before start"):
        v.leaves_during("a", 5.0, 4.0)


# -- speed --------------------------------------------------------------------------------


def _slow_nodes(ids: list[str], seed: int, fraction: float) -> set[str]:
    v = Volunteers.of(ids, seed, speed=f"slow:fraction={fraction},factor=10")
    return {node for node in ids if v.slowness(node) == 10.0}


@pytest.mark.parametrize(("n", "fraction"), [(50, 0.2), (7, 0.5), (10, 0.15), (3, 1.0), (5, 0.0), (1, 0.6)])
def test_slow_picks_exactly_round_fraction_n(n: int, fraction: float) -> None:
    ids = IDS[:n]
    slow = _slow_nodes(ids, 0, fraction)
    assert len(slow) == round(fraction * n)
    v = Volunteers.of(ids, 0, speed=f"slow:fraction={fraction},factor=10")
    assert all(v.slowness(node) == 1.0 for node in set(ids) - slow)


def test_slow_choice_is_seeded_and_independent_of_id_order() -> None:
    chosen = _slow_nodes(IDS, 3, 0.2)
    assert _slow_nodes(IDS, 3, 0.2) == chosen
    shuffled = list(IDS)
    random.Random(1).shuffle(shuffled)
    assert _slow_nodes(shuffled, 3, 0.2) == chosen
    assert _slow_nodes(IDS, 4, 0.2) != chosen


def test_lognormal_median_node_has_factor_one_and_sigma_spreads() -> None:
    v = Volunteers.of(IDS[:49], 0, speed="lognormal:sigma=1")
    factors = [v.slowness(node) for node in IDS[:49]]
    assert statistics.median(factors) == 1.0
    assert min(factors) < 0.5 and max(factors) > 2  # exp(N(0,1)) spreads over 49 nodes
    even = Volunteers.of(IDS, 0, speed="lognormal:sigma=1")
    assert 1.0 in [even.slowness(node) for node in IDS]  # the lower median node
    flat = Volunteers.of(IDS, 0, speed="lognormal:sigma=0")
    assert {flat.slowness(node) for node in IDS} == {1.0}
    other = Volunteers.of(IDS, 1, speed="lognormal:sigma=1")
    assert [other.slowness(node) for node in IDS] != [even.slowness(node) for node in IDS]


def test_lognormal_log_spread_matches_sigma() -> None:
    ids = [f"n{i}" for i in range(2000)]
    v = Volunteers.of(ids, 0, speed="lognormal:sigma=0.5")
    logs = [math.log(v.slowness(node)) for node in ids]
    assert statistics.stdev(logs) == pytest.approx(0.5, rel=0.08)


def test_compute_seconds() -> None:
    v = Volunteers.of(IDS[:10], 0, speed="slow:fraction=0.5,factor=10")
    slow = next(node for node in IDS[:10] if v.slowness(node) == 10.0)
    fast = next(node for node in IDS[:10] if v.slowness(node) == 1.0)
    assert v.compute_seconds(slow, 5, 0.25) == 12.5
    assert v.compute_seconds(fast, 5, 0.25) == 1.25
    assert v.compute_seconds(fast, 0, 0.25) == 0.0


# -- link and arrival ---------------------------------------------------------------------


def test_transfer_time_formula() -> None:
    v = Volunteers.of(["a"], 0, link="home:up_mbps=8,down_mbps=16,latency_ms=40")
    assert v.upload_seconds("a", 1_000_000) == pytest.approx(1.0 + 0.04)  # 1 MB at 8 Mbps = 1 s + latency
    assert v.download_seconds("a", 1_000_000) == pytest.approx(0.5 + 0.04)
    assert v.transfer_seconds("a", 1_000_000, 1_000_000) == pytest.approx(1.58)
    assert v.transfer_seconds("a", 0, 0) == pytest.approx(0.08)  # the latency, each way
    lan = Volunteers.of(["a"], 0, link="lan")
    assert lan.transfer_seconds("a", 125_000_000, 0) == pytest.approx(1.0 + 0.002)  # 1 Gbps


def test_no_link_is_instant() -> None:
    v = Volunteers.of(IDS, 0)
    assert v.transfer_seconds(IDS[0], 10**9, 10**9) == 0.0


def test_link_sigma_spreads_bandwidth_around_the_given_median() -> None:
    v = Volunteers.of(IDS[:49], 0, link="home:up_mbps=8,down_mbps=8,latency_ms=0,sigma=1")
    uploads = [v.upload_seconds(node, 1_000_000) for node in IDS[:49]]
    assert statistics.median(uploads) == pytest.approx(1.0)
    assert max(uploads) / min(uploads) > 4


def test_a_list_of_links_goes_to_the_nodes_in_turn() -> None:
    links = ["home:up_mbps=2,down_mbps=20,latency_ms=0", "home:up_mbps=20,down_mbps=100,latency_ms=0", "lan"]
    v = Volunteers.of(list(reversed(IDS[:7])), 0, link=links)  # in sorted id order, whatever the ids' order
    ups = [v.upload_seconds(node, 1_000_000) for node in IDS[:7]]
    assert ups == pytest.approx([4.0, 0.4, 0.009, 4.0, 0.4, 0.009, 4.0])
    assert v.download_seconds(IDS[1], 1_000_000) == pytest.approx(0.08)
    spread = Volunteers.of(IDS[:6], 0, link=["home:up_mbps=8,latency_ms=0,sigma=1", "lan"])
    assert len({spread.upload_seconds(node, 10**6) for node in IDS[0:6:2]}) == 3  # sigma among the nodes it serves
    assert Volunteers.of(IDS[:2], 0, link=["lan", "home", "home"]).upload_seconds(IDS[1], 0) == 0.04  # extra links idle
    with pytest.raises(ValueError, match="a list of links needs at least one"):
        Volunteers.of(IDS[:2], 0, link=[])


def test_arrival_is_the_sum_of_its_parts() -> None:
    v = Volunteers.of(IDS, 7, speed="lognormal:sigma=1", link="home")
    for node in IDS[:5]:
        got = v.arrival(node, 3.0, 10, 0.02, 400_000, 800_000)
        parts = 3.0 + v.compute_seconds(node, 10, 0.02) + v.transfer_seconds(node, 400_000, 800_000)
        assert got == pytest.approx(parts, rel=1e-12)
        assert got > 3.0 + 2 * 0.04


def test_same_scenario_and_seed_same_bits() -> None:
    def times(seed: int) -> list[float]:
        v = Volunteers.of(IDS, seed, speed="lognormal:sigma=1", link="home:sigma=0.5", churn="leave:p=0.1")
        return [v.arrival(node, 1.5, 7, 0.01, 12345, 67890) for node in IDS] + \
            [float(v.online(node, 40)) for node in IDS]

    assert times(5) == times(5)
    assert times(5) != times(6)


# -- churn --------------------------------------------------------------------------------


def test_no_churn_is_always_online() -> None:
    v = Volunteers.of(IDS, 0)
    assert all(v.online(node, e) for node in IDS for e in (0, 1, 10**6))
    assert not v.leaves_during(IDS[0], 0.0, 1e9)
    assert v.back_at(IDS[0], 12.5) == 12.5


def test_churn_stationary_share_online() -> None:
    ids = [f"n{i}" for i in range(200)]
    v = Volunteers.of(ids, 0, churn="leave:p=0.1,back=0.3")
    assert all(v.online(node, 0) for node in ids)  # everyone starts online
    share = statistics.mean(v.online(node, e) for node in ids for e in range(50, 550))
    assert share == pytest.approx(0.3 / (0.1 + 0.3), abs=0.02)
    rare = Volunteers.of(ids, 0, churn="leave:p=0.02,back=0.2")
    share = statistics.mean(rare.online(node, e) for node in ids for e in range(100, 600))
    assert share == pytest.approx(0.2 / 0.22, abs=0.02)


def test_churn_is_a_pure_function_of_seed_node_epoch() -> None:
    spec = "leave:p=0.2,back=0.3"
    forward = Volunteers.of(IDS, 9, churn=spec)
    states = {(node, e): forward.online(node, e) for node in IDS for e in range(60)}
    backward = Volunteers.of(list(reversed(IDS)), 9, churn=spec)
    assert all(backward.online(node, e) == states[node, e] for node in IDS for e in reversed(range(60)))
    fresh = Volunteers.of(IDS, 9, churn=spec)
    assert fresh.online(IDS[3], 5) == states[IDS[3], 5]  # 5 asked before 3
    assert fresh.online(IDS[3], 3) == states[IDS[3], 3]
    fewer = Volunteers.of(IDS[:2] + [IDS[3]], 9, churn=spec)  # the population does not matter
    assert [fewer.online(IDS[3], e) for e in range(60)] == [states[IDS[3], e] for e in range(60)]
    other = Volunteers.of(IDS, 10, churn=spec)
    assert [other.online(n, e) for n in IDS for e in range(60)] != [states[n, e] for n in IDS for e in range(60)]


def test_churn_transitions_follow_p_and_back() -> None:
    ids = [f"n{i}" for i in range(300)]
    v = Volunteers.of(ids, 2, churn="leave:p=0.1,back=0.4")
    stay = leave = come = absent = 0
    for node in ids:
        chain = [v.online(node, e) for e in range(200)]
        for a, b in zip(chain, chain[1:]):
            stay += a and b
            leave += a and not b
            come += (not a) and b
            absent += not a and not b
    assert leave / (leave + stay) == pytest.approx(0.1, abs=0.01)
    assert come / (come + absent) == pytest.approx(0.4, abs=0.02)


def test_async_epochs_leaves_during_and_back_at() -> None:
    v = Volunteers.of(IDS, 1, churn="leave:p=0.3,back=0.3,period=10")
    assert (v.epoch_at(0.0), v.epoch_at(9.999), v.epoch_at(10.0), v.epoch_at(35.0)) == (0, 0, 1, 3)
    for node in IDS:
        chain = [v.online(node, e) for e in range(30)]
        assert v.online_at(node, 25.0) == chain[2]
        assert v.leaves_during(node, 5.0, 27.0) == (not all(chain[0:3]))
        assert v.leaves_during(node, 21.0, 29.0) == (not chain[2])
        off = next((e for e in range(30) if not chain[e]), None)
        if off is not None and True in chain[off:]:
            assert v.back_at(node, off * 10 + 3.0) == chain.index(True, off) * 10.0
    gone = Volunteers.of(IDS, 1, churn="leave:p=1,back=0,period=10")
    assert gone.online(IDS[0], 0) and not gone.online(IDS[0], 1)
    assert gone.back_at(IDS[0], 15.0) == math.inf
    assert gone.back_at(IDS[0], 5.0) == 5.0


# -- events and metrics -------------------------------------------------------------------


def test_event_queue_orders_by_time_then_node_then_push() -> None:
    q = EventQueue()
    q.push(2.0, "b", "b-late")
    q.push(1.0, "c", "c1")
    q.push(1.0, "a", "a1")
    q.push(1.0, "c", "c2")
    q.push(0.5, "z", "z")
    assert len(q) == 5 and q.peek().payload == "z"
    assert [e.payload for e in q.pop_until(1.0)] == ["z", "a1", "c1", "c2"]
    event = q.pop()
    assert (event.time, event.node, event.payload) == (2.0, "b", "b-late")
    assert len(q) == 0 and q.peek() is None
    with pytest.raises(IndexError, match="the event queue is empty"):
        q.pop()
    with pytest.raises(ValueError, match="time must be a finite number of seconds >= 0"):
        q.push(math.nan, "a")


def test_event_queue_order_does_not_depend_on_push_order_across_nodes() -> None:
    events = [(t, node) for t in (0.0, 1.0, 1.0, 3.0) for node in ("x", "m", "a")]
    orders = []
    for seed in range(3):
        shuffled = list(events)
        random.Random(seed).shuffle(shuffled)
        q = EventQueue()
        for t, node in shuffled:
            q.push(t, node, {"unorderable": object()})  # payloads are never compared
        orders.append([(e.time, e.node) for e in (q.pop() for _ in range(len(events)))])
    assert orders[0] == orders[1] == orders[2] == sorted(events)


def test_traffic_totals_and_per_node() -> None:
    t = Traffic()
    t.add("b", up=100, down=1000)
    t.add("a", down=1000)
    t.add("b", up=50)
    assert (t.bytes_up, t.bytes_down) == (150, 2000)
    assert t.record() == {"bytes_up": 150, "bytes_down": 2000, "per_node": {"a": [0, 1000], "b": [150, 1000]}}
    assert list(t.record()["per_node"]) == ["a", "b"]
    with pytest.raises(ValueError, match="up must be an integer >= 0"):
        t.add("a", up=-5)


def test_measure_step_seconds_calls_the_step() -> None:
    calls = []
    seconds = measure_step_seconds(lambda: calls.append(1), repeat=3, warmup=2)
    assert len(calls) == 5 and seconds > 0  # never asserts on the measured time itself
    with pytest.raises(ValueError, match="repeat must be an integer >= 1"):
        measure_step_seconds(lambda: None, repeat=0)


def test_no_global_random_state_is_used() -> None:
    torch_state, python_state = torch.random.get_rng_state(), random.getstate()
    v = Volunteers.of(IDS, 0, speed="slow:fraction=0.2,factor=10", link="home:sigma=1", churn="leave:p=0.2")
    Volunteers.of(IDS, 0, speed="lognormal:sigma=1")
    for node in IDS:
        v.arrival(node, 0.0, 3, 0.1, 1000, 1000)
        v.leaves_during(node, 0.0, 600.0)
        v.back_at(node, 300.0)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert random.getstate() == python_state


def test_a_timeline_measures_one_local_step_once_per_kind_of_task(monkeypatch) -> None:
    from types import SimpleNamespace

    from evaluation.simtime import timeline

    calls = []
    monkeypatch.setattr(timeline, "MEASURED", {})  # this test's own: nothing measured before it
    monkeypatch.setattr(timeline, "measure_step_seconds", lambda update: calls.append(update) or 1.6)
    settings = SimpleNamespace(compression="none", downlink="none")
    lines = [timeline.Timeline({}, IDS[:3], seed, settings, 16, 10) for seed in (0, 1, 2)]
    for line, kind in zip(lines, ("mlp", "mlp", "cnn")):
        line.measure(kind, (kind, "digits", 32))
    assert calls == ["mlp", "cnn"]  # one measurement a kind of task, in this process
    assert [line.step_seconds for line in lines] == [0.1, 0.1, 0.1]  # a node update of 16 local steps: 1.6 s
    given = timeline.Timeline({"step-seconds": 0.5}, IDS[:3], 0, settings, 16, 10)
    given.measure("new", ("new",))
    assert given.step_seconds == 0.5 and calls == ["mlp", "cnn"]  # a given step time is never measured
