"""Spot checks under the ``momentum`` protocol (``nodes.engine.states``): each task names the
worker momentum its node continues from (its last row a round used), so a check recomputes
the row from the task's model and that momentum. A node whose reply was lost continues from
the named momentum and is cleared; one that carried its unseen work on, or forged, is
convicted; across compute profiles the row is refereed as the one step it is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun
from nodes import checkpoint
from nodes.coordinator import audit
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.inbox import Inbox
from nodes.engine.referee import settle_step
from nodes.engine.states import ZERO
from nodes.engine.training import NodeData, compute, redo_momentum
from nodes.settings import Settings
from nodes.volunteer import faults, volunteer
from nodes.volunteer.volunteer import work
from nodes.wire import Task
from robust import keys
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256

from .federation_kit import ask, file, fingerprint, make_federation, withdraw

SETTINGS = dict(rounds=4, aggregator="trimmed-mean", tolerate=1, protocol="momentum", batch_size=16, spot_check=1.0,
                verifier="self", quarantine_after=1000)


def test_momentum_checks_need_sync_rounds_and_no_codec():
    assert Settings(spot_check=0.5, protocol="momentum").spot_check == 0.5
    with pytest.raises(ValueError, match="needs round=sync"):
        Settings(spot_check=0.5, protocol="momentum", round="async")
    with pytest.raises(ValueError, match="needs compression=none"):
        Settings(spot_check=0.5, protocol="momentum", compression="int8")


def _round(coord: Coordinator, nodes: list[Path], lost: set[str] = frozenset(), attacks: dict[int, str] | None = None,
           unnamed: set[str] = frozenset()) -> dict:
    """One in-process round: every node computes its reply (its momentum moves), the ``lost``
    ones never arrive; an ``unnamed`` node ignores the momentum its task names and continues
    from the one it carries (as before tasks named any)."""
    asked = coord.select([fingerprint(n) for n in nodes])
    for fp in asked:
        withdraw(coord, fp)
    tasks, w = ask(coord, asked)
    inbox = Inbox()
    for i, node in enumerate(nodes, start=1):
        fp = fingerprint(node)
        if fp not in tasks:  # convicted: not asked
            continue
        task = tasks[fp] if fp not in unnamed else dataclasses.replace(tasks[fp], state="")
        attack = (attacks or {}).get(i, "")
        reply, row = work(task, w, NodeData.load(next(node.glob("data-*.pt"))), keys.load_private(node),
                          torch.device("cpu"), attack, node, f"{i}/{len(nodes)}")
        if fp in lost:
            withdraw(coord, fp)
        else:
            file(coord, fp, faults.content(attack, reply, row), inbox)
    return coord.finish_round(asked, inbox, 0.0)


def test_a_lost_reply_continues_from_the_named_momentum_a_carried_one_and_a_forger_are_convicted(tmp_path):
    folder, nodes = make_federation(tmp_path, 5, Settings(**SETTINGS))
    coord = Coordinator(folder)
    a, b, forger = fingerprint(nodes[0]), fingerprint(nodes[1]), fingerprint(nodes[4])
    assert coord.tasks([a])[0][a].state == ZERO
    first = _round(coord, nodes, attacks={5: "forge:scale=0.9"})
    assert first["convicted"] == [forger] and len(first["spot"]) == 5
    kept = json.loads((folder / checkpoint.ROUNDS).read_text().splitlines()[0])["updates"][a]["sha256"]
    second = _round(coord, nodes, lost={a})  # a trained, its reply never came: its momentum moved unseen
    assert a not in second["ids"] and second["convicted"] == []
    assert coord.tasks([a])[0][a].state == kept  # its next task continues from its round-1 row
    assert Coordinator(folder).engine.named_state(a) == kept  # the checkpoint keeps the named momenta
    third = _round(coord, nodes, lost={b})
    assert a in third["ids"] and third["convicted"] == []  # a continued from its round-1 row: checked, cleared
    fourth = _round(coord, nodes, unnamed={b})  # b carries its unseen round-3 work on
    assert fourth["convicted"] == [b]
    assert all(v["distance"] == 0 for r in (first, second, third, fourth) for v in r["spot"] if not v["guilty"])
    assert audit.main(str(folder)) == 0


def test_across_profiles_a_momentum_row_is_refereed_as_one_step(tmp_path, monkeypatch):
    folder, nodes = make_federation(tmp_path, 4, Settings(**(SETTINGS | {"rounds": 2})))
    monkeypatch.setattr(volunteer, "profile_of", lambda device: "cpu/another-machine")  # every volunteer declares one
    coord = Coordinator(folder)
    forger = fingerprint(nodes[3])
    for _ in range(2):
        record = _round(coord, nodes, attacks={4: "forge:scale=0.999"})
        notes = {v["author"]: v["note"] for v in record["spot"]}
        assert all(notes[fp].startswith("one step across profiles: cleared") for fp in notes if fp != forger)
    assert {fp for r in json.loads("[" + ",".join((folder / checkpoint.ROUNDS).read_text().splitlines()) + "]")
            for fp in r["convicted"]} == {forger}


def test_the_step_rule_clears_another_honest_rounding_and_convicts_a_scaled_or_restarted_row():
    task = Task.of(Settings(**(SETTINGS | {"model": "cnn"})), "run", 3, "base")
    ds = load("digits")
    x, y = ds.x_train[:200], ds.y_train[:200]
    model = build_model("cnn", tuple(x.shape[1:]), ds.classes, task.seed)
    w = flat_params(model)
    before = compute(task, w, x, y, ds.classes, "node", torch.device("cpu"))[1] * 3  # some momentum
    honest = compute(task, w, x, y, ds.classes, "node", torch.device("cpu"), "", before)[0]
    assert torch.equal(honest, redo_momentum(task, w, before, x, y, ds.classes, "node", torch.device("cpu")))
    other = redo_momentum(task, w, before, x, y, ds.classes, "node", torch.device("cpu"), precise=True).float()
    assert not torch.equal(other, honest)  # float64 rounded once: a rounding another machine could make
    cpu = torch.device("cpu")
    for row in (honest, other):
        assert not settle_step(task, w, before, row, x, y, ds.classes, "node", cpu).guilty
    restarted = compute(task, w, x, y, ds.classes, "node", cpu)[0]  # from zero, not the named momentum
    for row in (honest * 0.9999, restarted):
        ruling = settle_step(task, w, before, row, x, y, ds.classes, "node", cpu)
        assert ruling.guilty and "not the task's step" in ruling.reason


# 8 nodes that come and go (churn) and a quorum of 6: in a round below it every row computed is
# left unused, and its nodes' next tasks name their older momenta; every used row is checked
BENCH = {"dataset": "digits", "model": "mlp", "nodes": 8, "byzantine": 2, "rounds": 10, "partition": "iid",
         "alpha": 1.0, "protocol": "momentum", "step-seconds": 0.01, "spot-check": 1.0, "quarantine-after": 1000,
         "churn": "leave:p=0.3,back=0.6", "quorum": 6}


@pytest.mark.parametrize("vectorize", [False, True])
def test_the_bench_checks_momentum_rows_after_unused_ones_and_convicts_only_forgers(vectorize):
    for attack in ("none", "forge:scale=0.99"):
        run = CellRun(Cell(BENCH, "trimmed-mean", attack, 0), vectorize)
        log = []
        while (record := run.play_round()) is not None:
            log.append(record)
        assert {fp for r in log for fp in r["convicted"]} == (set() if attack == "none" else run.setup.byzantine)
        if attack == "none":  # (without named momenta, 5 of the 8 were convicted here)
            unused = {(r["round"], fp) for r in log if r["skipped"] for fp in r["ids"]}
            after = sum(any((t, v["author"]) in unused for t in range(1, r["round"])) for r in log for v in r["spot"])
            assert len(unused) > 10 and after > 10, (unused, after)  # rows unused, their nodes checked later


def test_real_processes_at_other_cpu_levels_clear_honest_momentum_rows_and_convict_every_cheat():
    """``python -m evaluation.disputes --protocol momentum``, small: each CPU level a process of
    its own, each row refereed as one step at the other level."""
    from evaluation.microbench.dispute_grid import measure
    from robust.profiles import Profile

    levels = [s for s in ("cpu:isa=default", "cpu:isa=avx2") if Profile.parse(s).refusal() is None]
    if len(levels) < 2:
        pytest.skip("this CPU has no AVX2: one CPU level only")
    result = measure(2, 4, levels, protocol="momentum")
    assert [p["effective"] for p in result["profiles"]] == ["DEFAULT", "AVX2"]
    assert result["honest_checks"] == 8 and result["honest_pairs_differing"] > 0 and result["false_convictions"] == 0
    assert all(c["checked"] == c["convicted"] == 1 for c in result["cheats"].values()), result["cheats"]
