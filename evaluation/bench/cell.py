"""A benchmark cell (scenario x aggregator x attack x seed), built the same way for every driver.

:class:`CellSetup` turns a cell into a federation: the coordinator's :class:`Settings`, the
data, and ``n`` nodes. Node ``i`` (1-based) has the key ``keys.generate(("bench", seed, i))``
(as ``nodes.commands.local_federation`` derives it), so the bench and a replay through real
processes have the same identities, hence the same batch and poison streams and the same
canonical order (by key fingerprint). Node ``i`` holds part ``i`` of the seeded partition;
the Byzantine nodes are a seeded choice of ``byzantine`` of them.

:func:`cell_record` turns the round engine's per-round records into the cell's result
record, whichever driver produced them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

import attacks
from attacks.base import Memory, NodeAttack
from nodes.coordinator.admission import short
from nodes.engine.protocol import Protocol
from nodes.settings import RUN, Settings
from robust import keys
from robust.compute import profile
from robust.data import Dataset, load
from robust.models import build_model
from robust.partition import partition
from robust.profiles import Profile
from robust.seeds import generator
from robust.spec import format_spec, parse

from evaluation.reports.metrics import kappa_bound, summarize_detection

KEY_SEED = "bench"
SHARED = [k for k in RUN if k not in ("seed", "aggregator", "tolerate")]  # RUN keys a scenario sets


@dataclass
class Cell:
    """One run of the grid: scenario values, the defence, the attack, the seed."""

    config: dict
    aggregator: str
    attack: str
    seed: int
    sweep: dict | None = field(default=None)


def cell_settings(cell: Cell, **deployment: object) -> Settings:
    """The coordinator settings of ``cell`` (``deployment``: port, deadline...). An
    asynchronous cell aggregates as many replies as its synchronous twin of ``rounds`` rounds
    would: ``rounds * ceil(nodes / buffer)`` buffers, each a round of the engine."""
    shared = {RUN[k].attr: cell.config[k] for k in SHARED if k in cell.config}
    f = cell.config.get("tolerate")
    settings = Settings(seed=cell.seed, aggregator=cell.aggregator,
                        tolerate=int(cell.config["byzantine"] if f is None else f),
                        **shared, **deployment)
    if settings.round == "async":
        nodes = int(cell.config["nodes"])
        buffers = math.ceil(nodes / settings.buffer_for(nodes))
        settings = settings.replace(rounds=settings.rounds * buffers)
    return settings


class CellSetup:
    """A cell's federation: settings, data, node identities, parts, the Byzantine nodes."""

    def __init__(self, cell: Cell) -> None:
        self.cell, cfg, seed = cell, cell.config, cell.seed
        self.settings = cell_settings(cell)
        self.n, self.f = int(cfg["nodes"]), int(cfg["byzantine"])
        self.attack = attacks.build(cell.attack, self.f)
        self.node_attack = cell.attack if isinstance(self.attack, NodeAttack) else ""
        # node i (1-based) -> its fingerprint; the ids in canonical order
        self.by_index = [keys.fingerprint(keys.generate((KEY_SEED, seed, i)).public_key()) for i in range(1, self.n + 1)]
        self.ids = sorted(self.by_index)
        chosen = torch.randperm(self.n, generator=generator(seed, "byzantine"))[: self.f].tolist()
        self.byzantine = {self.by_index[i] for i in chosen}

    @cached_property
    def data(self) -> Dataset:
        return load(self.settings.dataset, root=self.settings.data_root or None, seed=0)

    @cached_property
    def parts(self) -> dict[str, torch.Tensor]:
        """Each node's indices into the training set."""
        cfg = self.cell.config
        split = partition(self.data.strata, self.n, cfg["partition"], alpha=float(cfg["alpha"]), seed=self.cell.seed)
        return dict(zip(self.by_index, split))

    @cached_property
    def protocol(self) -> Protocol:
        return Protocol.of(self.settings)

    def model(self) -> torch.nn.Module:
        return build_model(self.settings.model, self.data.shape, self.data.classes, self.settings.seed)

    def profile_of(self, node: str) -> Profile:
        """Node ``node``'s compute profile: ``profiles`` given to the nodes in turn, in sorted id order."""
        value = self.cell.config.get("profiles", "cpu")
        specs = value if isinstance(value, list) else [value]
        return Profile.parse(specs[self.ids.index(node) % len(specs)])

    def attack_of(self, node: str) -> str:
        """What node ``node`` plays on its own side: a node-side attack if it is Byzantine
        (:attr:`node_attacks`)."""
        return self.node_attacks.get(node, "")

    @cached_property
    def node_attacks(self) -> dict[str, str]:
        """Each Byzantine node's node-side attack spec; for an attack whose colluding nodes take
        distinct roles (its ``rank_key``, e.g. ``dba``'s ``part``) and a spec that leaves the key
        unset, with the node's rank among the Byzantine nodes in canonical order set."""
        if not self.node_attack:
            return {}
        key = self.attack.rank_key
        (comp,) = parse(self.node_attack)
        if key is None or key in comp.params:
            return dict.fromkeys(self.byzantine, self.node_attack)
        return {fp: format_spec([replace(comp, params={**comp.params, key: rank})])
                for rank, fp in enumerate(sorted(self.byzantine))}


def cell_record(setup: CellSetup, rounds: list[dict], w: torch.Tensor, kappa: list[float] | None,
                wall: float, training: float | None, engine: str, asr_at_stop: float | None = None,
                kept: Sequence[Memory] = ()) -> dict:
    """The result record of a cell from its engine records (one per round) and final model;
    ``asr_at_stop``: the backdoor's success on the model of round :func:`backdoor_stop` (the
    drivers that keep only the final model leave it ``None``); ``kept``: the Byzantine nodes' last
    :class:`~attacks.base.Memory` (:func:`backdoor_success`)."""
    cell, n, f = setup.cell, setup.n, setup.f
    positive = [torch.tensor([i in setup.byzantine for i in r["ids"]], dtype=torch.bool) for r in rounds]
    scores = [{k: torch.tensor(v, dtype=torch.float64) for k, v in r["scores"].items()} for r in rounds]
    first_quarantine = {}
    for index, r in enumerate(rounds):
        for node in r["quarantined"]:
            first_quarantine.setdefault(node, index)
    to_quarantine = {short(b): first_quarantine.get(b) for b in sorted(setup.byzantine)}
    caught = max(to_quarantine.values()) if to_quarantine and None not in to_quarantine.values() else None
    convicted = {fp: r["round"] for r in rounds for fp in r.get("convicted", [])}
    finite = [k for k in kappa or [] if k == k]
    steps = _node_steps(setup, rounds)
    return {
        "aggregator": cell.aggregator, "attack": cell.attack, "seed": cell.seed,
        "config": cell.config, "sweep": cell.sweep, "engine": engine,
        "final_accuracy": rounds[-1]["accuracy"], "accuracy": [r["accuracy"] for r in rounds],
        "final_loss": rounds[-1]["loss"], "loss": [r["loss"] for r in rounds], "data_sha256": setup.data.sha256 or None,
        "detect": summarize_detection(scores, positive),
        "kappa": kappa, "kappa_max": max(finite, default=math.nan) if kappa is not None else None,
        "kappa_bound": kappa_bound(n, f) if n > 2 * f else math.inf,
        "rejected": sum(len(r["rejected"]) for r in rounds), "skipped_rounds": sum(bool(r["skipped"]) for r in rounds),
        "byzantine": sorted(short(b) for b in setup.byzantine),
        "rounds_to_quarantine": to_quarantine, "caught_round": caught,
        "false_quarantines": len(set(rounds[-1]["quarantined"]) - setup.byzantine),
        "spot_checks": sum(len(r.get("spot", [])) for r in rounds),
        "round_convicted": {short(b): convicted.get(b) for b in sorted(setup.byzantine)},
        "false_convictions": len(set(convicted) - setup.byzantine),
        "backdoor_asr": backdoor_success(setup, w, kept),
        "backdoor_stop_round": backdoor_stop(setup), "backdoor_asr_at_stop": asr_at_stop,
        "model_sha256": rounds[-1]["model_sha256"], "wall_time": wall,
        "node_steps_per_s": steps / wall if wall > 0 else None,
        "train_node_steps_per_s": steps / training if training else None,
    }


def _node_steps(setup: CellSetup, rounds: list[dict]) -> int:
    """Local steps computed by the nodes asked over the run."""
    return sum(r["asked"] for r in rounds) * setup.protocol.steps


def backdoor_stop(setup: CellSetup) -> int | None:
    """The last round a backdoor's nodes attack (its ``stop_after``), if the run goes on after it."""
    attack = setup.attack
    if isinstance(attack, NodeAttack) and attack.plants_backdoor and 0 < attack.stop_after < setup.settings.rounds:
        return attack.stop_after
    return None


def backdoor_success(setup: CellSetup, w: torch.Tensor, kept: Sequence[Memory] = ()) -> float | None:
    """How much of its backdoor the model ``w`` carries (``NodeAttack.success``): ``backdoor``
    and the attacks built on it (triggered test samples classified as the target),
    ``text-backdoor`` (held-out prompts after whose trigger greedy decoding writes the
    attacker's continuation); ``None`` for any other attack. For an attack whose trigger
    changes (it :attr:`~attacks.base.NodeAttack.sees_model`: ``a3fl``), the mean of its success
    with each trigger the Byzantine nodes ``kept`` (their last rounds' :class:`~attacks.base.Memory`,
    in canonical order; none kept: its starting pattern)."""
    attack = setup.attack
    if not isinstance(attack, NodeAttack) or not attack.plants_backdoor:
        return None
    data, lasts = setup.data, (list(kept) if attack.sees_model else []) or [None]
    with profile(setup.settings.threads):
        model = setup.model()
        return sum(attack.success(model, w, data.x_test, data.y_test, last) for last in lasts) / len(lasts)

