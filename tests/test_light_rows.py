"""What light nodes replay (``evaluation.field.light_nodes.precompute``): honest nodes the engine's update
from the initial model on their part of the data; Byzantine nodes what the attack makes of it
(a node-side attack its own poisoned update, forged as a volunteer forges it; an omniscient
one its rows from the honest rows), each with its part's sample count."""

from __future__ import annotations

import torch

import attacks
from attacks.base import Context
from evaluation.field.light_nodes import precompute
from nodes.engine.training import compute, part_of
from nodes.settings import Settings
from nodes.volunteer.volunteer import forge
from nodes.wire import Task
from robust import keys
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256
from robust.seeds import generator

KEYS = [keys.generate(seed=("light-rows", i)) for i in range(5)]
FPS = [keys.fingerprint(k.public_key()) for k in KEYS]
SETTINGS = Settings(model="logreg", protocol="delta:steps=2", tolerate=1)


def honest_rows(attack_of_last: str = "") -> list[torch.Tensor]:
    data = load(SETTINGS.dataset, seed=0)
    w = flat_params(build_model(SETTINGS.model, data.shape, data.classes, SETTINGS.seed)).detach()
    task = Task.of(SETTINGS, "run", 1, sha256(w))
    parts = [part_of(data, f"{i}/5") for i in range(1, 6)]
    rows = [compute(task, w, p.x, p.y, p.classes, fp, torch.device("cpu"), attack_of_last if i == 4 else "")[0]
            for i, (p, fp) in enumerate(zip(parts, FPS))]
    rows[4] = forge(attack_of_last, rows[4], None, 1)
    return rows


def test_honest_nodes_replay_the_engines_update_and_declare_their_part():
    rows = precompute(SETTINGS, "run", KEYS, 0, "none")
    expected = honest_rows()
    data = load(SETTINGS.dataset, seed=0)
    for i, (row, want) in enumerate(zip(rows, expected), start=1):
        assert torch.equal(torch.from_numpy(row.values), want) and row.sha == sha256(want)
        assert row.part == f"{i}/5" and row.count == len(part_of(data, f"{i}/5").y)


def test_an_omniscient_attacker_replays_its_rows_from_the_honest_ones():
    rows = precompute(SETTINGS, "run", KEYS, 1, "alie")
    honest = honest_rows()
    crafted = attacks.build("alie", 1)(torch.stack(honest[:4]), Context(n=5, generator=generator(SETTINGS.seed, 1, "attack")))
    assert all(torch.equal(torch.from_numpy(r.values), h) for r, h in zip(rows[:4], honest[:4]))
    assert torch.equal(torch.from_numpy(rows[4].values), crafted[0]) and not torch.equal(crafted[0], honest[4])


def test_a_node_side_attacker_replays_its_own_poisoned_update():
    rows = precompute(SETTINGS, "run", KEYS, 1, "label-flip")
    assert torch.equal(torch.from_numpy(rows[4].values), honest_rows("label-flip")[4])
    assert not torch.equal(torch.from_numpy(rows[4].values), honest_rows()[4])
