"""Refereed disputes across compute profiles: honest hardware cleared, every cheat convicted.

``python -m evaluation.disputes [--rounds R] [--nodes N] [--profiles SPEC ...] [--json]``
plays a crowd of volunteers on mixed hardware emulated on one machine: each compute profile
(``robust.profiles``: ``cpu:isa=default``, ``cpu:isa=avx2``, ``cpu:isa=avx512``, ``cuda`` where
a GPU is) runs in a process of its own (``evaluation.microbench.profile_worker``). Nodes take the
profiles in turn; they train the digits CNN under ``delta:steps=16`` from a base model that moves
each round by the mean honest row (a model in training, not a random walk). Each node commits to
its trajectory (``nodes.engine.committed``). Every row is then checked by a referee on each
*other* profile, as the coordinator's spot check does (``nodes.engine.spotcheck.compare``, across
profiles): a row farther than :data:`DISPUTE_ABOVE` from the referee's recomputation opens a
dispute (``nodes.engine.referee``). ``--settle-share`` of the honest checks that stayed below it,
and whose bits differ, are disputed as well, so the per-step rule is tried on honest pairs far
more often than chance would.

The referee replays a disputed step at the author's declared CPU level, as a coordinator can
(a process per level, ``robust.profiles``): one step of the digits CNN on ``cpu:isa=default``
was once 1.2e-4 from float64 where the AVX2 and AVX-512 kernels were 3e-7 from it (a conv
filter's weight gradient), a gap no per-step bound can tell from a 0.9999 forgery. A GPU
author's steps are replayed at the referee's own level, under the bound and near-ties. The
result also gives what replaying every CPU author at the referee's own level would have
decided (``at_referee_level``).

Besides the honest nodes, one node per cheat (``lazy``, ``forge`` at several scales, plain and
consistent, ``fewer-steps``, ``other-data``, ``replay-row``, ``bad-dispute``) is checked on every
round after its first. The last line with ``--json`` is one object: ``honest_checks``,
``honest_pairs_differing``, ``disputes``, ``false_convictions``, ``cheats`` (each: ``checked``,
``convicted``, and why), the largest honest whole-update and single-step gaps, and the cost per
dispute (round trips, bytes, referee seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from statistics import median

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from nodes.engine.referee import STEP_TOLERANCE
from nodes.engine.spotcheck import distance
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256
from robust.profiles import Profile

from . import momentum_grid
from .profile_worker import Crowd, Worker, round_ends

DISPUTE_ABOVE = 1e-5  # a whole update farther than this from the referee's recomputation is disputed
CHEATS = ("lazy", "forge:scale=0.999", "forge:scale=0.999,consistent=true", "forge:scale=0.9999,consistent=true",
          "forge:scale=0.99999,consistent=true", "fewer-steps", "other-data", "replay-row", "bad-dispute:scale=0.9999")
ISAS = ("cpu:isa=default", "cpu:isa=avx2", "cpu:isa=avx512")


def task_fields(round: int, base: str, model: str, steps: int) -> dict:
    return {"run": "disputes", "round": round, "base": base, "seed": 0, "dataset": "digits", "model": model,
            "protocol": f"delta:steps={steps}", "batch_size": 32, "lr": 0.05, "momentum": 0.9, "threads": 1,
            "deadline": 60.0}


def measure(rounds: int, nodes: int, profiles: list[str], cheats: tuple[str, ...] = CHEATS, model: str = "cnn",
            steps: int = 16, settle_share: float = 0.1, copies: int = 1, progress=None,
            seconds: float = float("inf"), protocol: str = "delta") -> dict:
    """The measurement (see above); ``copies`` processes per profile share its nodes; ``protocol =
    momentum``: :mod:`evaluation.microbench.momentum_grid`'s instead."""
    for spec in profiles:  # refused before any process starts
        reason = Profile.parse(spec).refusal()
        if reason:
            raise ValueError(reason)
    workers = [[Worker(spec) for _ in range(copies)] for spec in profiles]
    try:
        for copy in (wk for group in workers for wk in group):
            copy.effective  # noqa: B018 - each started at once, then waited for
        if protocol == "momentum":
            return momentum_grid.measure(workers, rounds, nodes, model, progress=progress,
                                         until=time.perf_counter() + seconds)
        return _play(workers, rounds, nodes, cheats, model, steps, settle_share, progress,
                     time.perf_counter() + seconds)
    finally:
        for copy in (wk for group in workers for wk in group):
            copy.close()


def _play(workers: list[list[Worker]], rounds: int, nodes: int, cheats, model, steps, settle_share, progress,
          until: float) -> dict:
    data = load("digits", seed=0)
    w = flat_params(build_model(model, data.shape, data.classes, 0))
    people = Crowd(workers, nodes, cheats)
    crowd, parts, home, on, P = people.members, people.parts, people.home, people.on, len(workers)
    gen = np.random.default_rng(0)
    out = Counter()
    pairs = defaultdict(Counter)  # (author profile, referee profile) -> counts
    whole_gaps, step_gaps, costs, false, own_false = [], [], [], [], []
    cheat = {spec: {"checked": 0, "convicted": 0, "reasons": Counter()} for spec in cheats}
    for r in range(1, rounds + 1):
        fields = task_fields(r, sha256(w), model, steps)
        base = w.numpy()
        for node, attack in crowd:  # each process trains its nodes one after another, the processes at once
            on(node, home[node]).send("author", fields, base, node, parts[node], attack)
        rows = {}
        for node, _ in crowd:
            row, root = on(node, home[node]).get()
            rows[node] = (torch.from_numpy(row.copy()), root)
        checks = [(node, attack, q) for node, attack in crowd for q in range(P) if q != home[node]
                  and not (attack and r == 1)]  # a cheat's first round: a replayer has nothing to replay yet
        for node, _, q in checks:
            on(node, q).send("recompute", fields, base, node, parts[node])
        disputes = []
        for node, attack, q in checks:
            redone = torch.from_numpy(on(node, q).get().copy())
            row = rows[node][0]
            gap, differ = distance(row, redone), not torch.equal(row, redone)
            pair = pairs[workers[home[node]][0].profile.spec, workers[q][0].profile.spec]
            if not attack:
                out["honest_checks"] += 1
                out["honest_pairs_differing"] += differ
                pair["checks"] += 1
                pair["differing"] += differ
                pair["max_gap_e9"] = max(pair["max_gap_e9"], round(gap * 1e9))
                whole_gaps.append(gap)
            else:
                cheat[attack]["checked"] += 1
            if not gap <= DISPUTE_ABOVE or (not attack and differ and gen.random() < settle_share):
                disputes.append((node, attack, q, gap))
            elif attack:
                cheat[attack]["reasons"]["passed the whole-update check"] += 1
        for node, attack, q, gap in disputes:  # the author answers (recomputing), a referee settles
            author = on(node, home[node])
            author.send("answer", fields, base, node, parts[node], attack)
            claim = author.get()
            # the referee replays each step at the author's declared CPU level, which any x86 referee
            # can run; a GPU author's steps on the referee's own level (tolerance and near-ties)
            level = home[node] if workers[home[node]][0].profile.kind == "cpu" else q
            settle = ("settle", fields, base, node, parts[node], rows[node][0].numpy(), rows[node][1], claim)
            began = time.perf_counter()
            on(node, level).send(*settle, level == home[node])
            ruling = on(node, level).get()
            ruling["wall"] = time.perf_counter() - began
            out["disputes"] += 1
            if not attack and level != q:  # the same claim replayed at the referee's own level, for the record
                on(node, q).send(*settle, False)
                own = on(node, q).get()
                out["own_level_disputes"] += 1
                out["own_level_false"] += own["guilty"]
                if own["guilty"]:
                    own_false.append(own["reason"])
                out["own_level_ties"] += own["near_ties"] > 0
            if not attack:
                costs.append(ruling)
                pair = pairs[workers[home[node]][0].profile.spec, workers[q][0].profile.spec]
                pair["disputes"] += 1
                pair["false_convictions"] += ruling["guilty"]
                out["false_convictions"] += ruling["guilty"]
                out["honest_cleared"] += not ruling["guilty"]
                out["near_ties"] += ruling["near_ties"] > 0
                if ruling["guilty"]:
                    false.append(f"round {r}, {node}, {workers[home[node]][0].profile.spec} refereed by "
                                 f"{workers[q][0].profile.spec}: {ruling['reason']}")
                if ruling["gap"] is not None:
                    step_gaps.append(ruling["gap"])
            else:
                cheat[attack]["convicted"] += ruling["guilty"]
                cheat[attack]["reasons"][ruling["reason"].split(" (")[0] if ruling["guilty"] else "cleared"] += 1
        honest = [rows[node][0] for node, attack in crowd if not attack]
        w = w + torch.stack(honest).mean(0)  # the model trains on
        if round_ends(r, out, progress, until):
            rounds = r
            break
    return {
        "model": model, "steps": steps, "rounds": rounds, "nodes": nodes, "params": w.numel(),
        "profiles": people.profiles,
        "honest_checks": out["honest_checks"], "honest_pairs_differing": out["honest_pairs_differing"],
        "disputes": out["disputes"], "honest_disputes_cleared": out["honest_cleared"],
        "cleared_by_near_ties": out["near_ties"],
        "at_referee_level": {"disputes": out["own_level_disputes"], "false_convictions": out["own_level_false"],
                             "cleared_by_near_ties": out["own_level_ties"], "reasons": Counter(
                                 why.split(" (")[0] for why in own_false).most_common(5)},
        "false_convictions": out["false_convictions"], "false_conviction_reasons": false[:10],
        "largest_honest_gap": max(whole_gaps, default=None), "largest_honest_step_gap": max(step_gaps, default=None),
        "dispute_above": DISPUTE_ABOVE, "step_tolerance": STEP_TOLERANCE,
        "pairs": [{"author": a, "referee": b, "checks": c["checks"], "bitwise_different": c["differing"],
                   "largest_gap": c["max_gap_e9"] / 1e9, "disputes": c["disputes"],
                   "false_convictions": c["false_convictions"]} for (a, b), c in sorted(pairs.items())],
        "cheats": {spec: {"checked": c["checked"], "convicted": c["convicted"], "reasons": dict(c["reasons"])}
                   for spec, c in cheat.items()},
        "per_dispute": {"round_trips": 1,  # the author's states in one answer
                        "bytes": median(c["bytes"] for c in costs) if costs else None,
                        "referee_seconds": median(c["seconds"] for c in costs) if costs else None,
                        "steps_checked": median(c["steps_checked"] for c in costs) if costs else None},
    }


def default_profiles() -> list[str]:
    """The CPU levels this machine has, and ``cuda`` where a GPU is."""
    specs = [spec for spec in ISAS if Profile.parse(spec).refusal() is None]
    if torch.cuda.is_available():
        specs.append("cuda")
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.disputes", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--nodes", type=int, default=100, help="honest nodes (the cheats come on top)")
    p.add_argument("--profiles", nargs="+", default=None, help="compute profiles (default: the three CPU levels, "
                   "and cuda where a GPU is)")
    p.add_argument("--model", default="cnn")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--settle-share", type=float, default=0.1,
                   help="share of honest bitwise-different checks below the dispute bound disputed anyway")
    p.add_argument("--copies", type=int, default=1, help="processes per profile (its nodes shared among them)")
    p.add_argument("--seconds", type=float, default=float("inf"), help="stop after the round that passes this")
    p.add_argument("--protocol", choices=("delta", "momentum"), default="delta",
                   help="momentum: spot checks from named momenta, each row refereed as one step "
                        "(evaluation.microbench.momentum_grid)")
    p.add_argument("--json", action="store_true", help="end with the result as one JSON line")
    args = p.parse_args(argv)
    if min(args.rounds, args.nodes, args.copies, args.steps) < 1 or not 0 <= args.settle_share <= 1:
        p.error("--rounds, --nodes, --copies and --steps must be at least 1, --settle-share within [0, 1]")
    console = Console(stderr=True)
    began = time.perf_counter()

    def progress(r: int, out: Counter) -> None:
        disputes = f"{out['disputes']} disputes, " if args.protocol == "delta" else ""
        console.print(f"round {r}/{args.rounds}: {out['honest_checks']} honest checks, {disputes}"
                      f"{out['false_convictions']} false convictions ({time.perf_counter() - began:.0f} s)")

    try:
        result = measure(args.rounds, args.nodes, args.profiles or default_profiles(), model=args.model,
                         steps=args.steps, settle_share=args.settle_share, copies=args.copies,
                         progress=progress, seconds=args.seconds, protocol=args.protocol)
    except ValueError as err:
        print(f"python -m evaluation.disputes: error: {err}", file=sys.stderr)
        return 2
    result["seconds"] = round(time.perf_counter() - began, 1)
    disputes = f"{result['disputes']} disputes, " if args.protocol == "delta" else ""
    table = Table(title=f"{args.protocol}: {result['honest_checks']} honest cross-profile checks "
                        f"({result['honest_pairs_differing']} bitwise different), {disputes}"
                        f"{result['false_convictions']} false convictions")
    for column in ("cheat", "checked", "convicted", "why"):
        table.add_column(column)
    for spec, c in result["cheats"].items():
        table.add_row(spec, str(c["checked"]), str(c["convicted"]), "; ".join(f"{k} x{v}" for k, v in c["reasons"].items()))
    console.print(table)
    if args.json:
        print(json.dumps(result))
    return 0
