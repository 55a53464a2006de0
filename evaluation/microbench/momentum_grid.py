"""Spot checks under ``momentum`` across compute profiles: honest hardware cleared, cheats convicted.

``python -m evaluation.disputes --protocol momentum [--rounds R] [--nodes N] [--json]`` plays
the crowd of :mod:`evaluation.microbench.dispute_grid` under the ``momentum`` protocol: each
compute profile in a process of its own, the nodes taking the profiles in turn, the digits
model moving each round by the protocol's step on the mean honest row. Each task names the
momentum its node continues from (``nodes.engine.states``: here every row is used, so its last
row), and every row is checked by a referee on each *other* profile as the coordinator checks
it: the one step from the named momentum to the row, under the per-step rule and near-ties
(``nodes.engine.referee.settle_step``).

Besides the honest nodes, one node per cheat is checked on every round after its first:
``forge`` (its row scaled, at 0.999, 0.9999 and 0.99999), ``lazy`` (its previous row sent
again), ``unseen`` (it continues from a momentum one unseen step further than the named one:
the work of a reply that never counted, carried on) and ``restart`` (from zero momentum). The
last line with ``--json`` is one object: ``honest_checks``, ``honest_pairs_differing``,
``false_convictions``, ``cheats`` (each ``checked``, ``convicted``), the largest honest
whole-update and step gaps, and the referee's seconds per check.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import median

import torch

from nodes.engine.spotcheck import distance
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256

from .profile_worker import Crowd, Worker, round_ends

CHEATS = ("forge:scale=0.999", "forge:scale=0.9999", "forge:scale=0.99999", "lazy", "unseen", "restart")
LR, BETA = 0.05, 0.9


def task_fields(round: int, base: str, model: str) -> dict:
    return {"run": "momentum-checks", "round": round, "base": base, "seed": 0, "dataset": "digits", "model": model,
            "protocol": "momentum", "batch_size": 32, "lr": LR, "momentum": BETA, "threads": 1, "deadline": 60.0}


def sent(cheat: str, row: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """What a node playing ``cheat`` sends for its honestly computed ``row`` (``forge``, ``lazy``;
    ``unseen`` and ``restart`` cheat in where they start from)."""
    if cheat.startswith("forge:scale="):
        return row * float(cheat.split("=", 1)[1])
    return previous if cheat == "lazy" else row


def measure(workers: list[list[Worker]], rounds: int, nodes: int, model: str = "cnn",
            cheats: tuple[str, ...] = CHEATS, progress=None, until: float = float("inf")) -> dict:
    """The measurement (see above) on the profiles' started ``workers``."""
    data = load("digits", seed=0)
    w = flat_params(build_model(model, data.shape, data.classes, 0))
    people = Crowd(workers, nodes, cheats)
    crowd, parts, home, on, P = people.members, people.parts, people.home, people.on, len(workers)

    named = {node: torch.zeros_like(w) for node, _ in crowd}  # what each node's task names: its last row
    out, pairs = Counter(), defaultdict(Counter)
    whole_gaps, step_gaps, seconds = [], [], []
    cheat = {spec: {"checked": 0, "convicted": 0, "reasons": Counter()} for spec in cheats}
    for r in range(1, rounds + 1):
        fields, base = task_fields(r, sha256(w), model), w.numpy()
        starts = dict(named)
        for node, attack in crowd:
            if attack == "restart":
                starts[node] = torch.zeros_like(w)
            elif attack == "unseen":  # one more step from its named momentum, at this model, that no round used
                on(node, home[node]).send("row", {**fields, "round": r + 10_000}, base, node, parts[node],
                                          named[node].numpy())
                starts[node] = torch.from_numpy(on(node, home[node]).get().copy())
        for node, _ in crowd:
            on(node, home[node]).send("row", fields, base, node, parts[node], starts[node].numpy())
        rows = {node: sent(attack, torch.from_numpy(on(node, home[node]).get().copy()), named[node])
                for node, attack in crowd}
        checks = [(node, attack, q) for node, attack in crowd for q in range(P) if q != home[node]
                  and not (attack and r == 1)]
        for node, _, q in checks:
            on(node, q).send("settle-step", fields, base, node, parts[node], named[node].numpy(), rows[node].numpy())
            on(node, q).send("row", fields, base, node, parts[node], named[node].numpy())
        for node, attack, q in checks:
            ruling, redone = on(node, q).get(), torch.from_numpy(on(node, q).get().copy())
            gap, differ = distance(rows[node], redone), not torch.equal(rows[node], redone)
            if attack:
                cheat[attack]["checked"] += 1
                cheat[attack]["convicted"] += ruling["guilty"]
                cheat[attack]["reasons"][ruling["reason"].split(" (")[0]] += 1
                continue
            pair = pairs[workers[home[node]][0].profile.spec, workers[q][0].profile.spec]
            out["honest_checks"] += 1
            out["honest_pairs_differing"] += differ
            out["false_convictions"] += ruling["guilty"]
            out["near_ties"] += ruling["near_ties"] > 0
            pair["checks"] += 1
            pair["differing"] += differ
            pair["false_convictions"] += ruling["guilty"]
            whole_gaps.append(gap)
            step_gaps.append(ruling["gap"])
            seconds.append(ruling["seconds"])
        honest = [rows[node] for node, attack in crowd if not attack]
        w = w - LR * torch.stack(honest).mean(0)  # the protocol's server step: the model trains on
        named = {node: rows[node] for node, _ in crowd}  # every row used: the next tasks name them
        if round_ends(r, out, progress, until):
            rounds = r
            break
    return {
        "protocol": "momentum", "model": model, "rounds": rounds, "nodes": nodes, "params": w.numel(),
        "profiles": people.profiles,
        "honest_checks": out["honest_checks"], "honest_pairs_differing": out["honest_pairs_differing"],
        "false_convictions": out["false_convictions"], "cleared_by_near_ties": out["near_ties"],
        "largest_honest_gap": max(whole_gaps, default=None),
        "largest_honest_step_gap": max(step_gaps, default=None),
        "referee_seconds": median(seconds) if seconds else None,
        "pairs": [{"author": a, "referee": b, "checks": c["checks"], "bitwise_different": c["differing"],
                   "false_convictions": c["false_convictions"]} for (a, b), c in sorted(pairs.items())],
        "cheats": {spec: {"checked": c["checked"], "convicted": c["convicted"], "reasons": dict(c["reasons"])}
                   for spec, c in cheat.items()},
    }
