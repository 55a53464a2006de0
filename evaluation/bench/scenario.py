"""Scenario files: a TOML ``[scenario]`` table whose list values expand to a grid of cells.

``seeds``, ``aggregators`` and ``attacks`` are lists by nature; any other key given a list
(``alpha = [0.1, 1.0]``) becomes one more axis of the grid, but ``link``'s and ``profiles``' list
of specs is given to the nodes in turn (``link = ["home:up_mbps=2", "lan"]``: the first node in
sorted id order on the first, the second on the second, the third on the first again), and a
list of such lists is its axis. ``--set key=value`` overrides a
key from the command line (``value`` in TOML syntax: ``--set rounds=20``,
``--set 'attacks=["none","alie"]'``).

Every key is declared once, as data: the keys a training run shares with the coordinator's
settings are ``nodes.settings.RUN``'s own (same names, rules and defaults); the others
(``SCENARIO``) are the bench's. A cell's settings are then built and checked exactly as a
coordinator's (``evaluation.bench.cell.cell_settings``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from pathlib import Path

import numpy as np

import aggregators
import attacks
from attacks.base import OmniscientAttack
from nodes.settings import RUN
from robust.constraints import Interval, OneOf, Param, Spec, check_all, table, unknown
from robust.partition import KINDS
from robust.profiles import check as check_profile
from robust.spec import Component, format_spec, parse

from .cell import SHARED, Cell, cell_settings
from evaluation.field.lab.wire_faults import build_faults
from evaluation.simtime.arrivals import CLOCK
from evaluation.reports.target_costs import OF

SCENARIO = {
    **{k: RUN[k] for k in SHARED},
    **table(
        Param("partition", OneOf(KINDS), "iid", "how the training set is split among nodes"),
        Param("alpha", Interval(float, 0, None, "neither"), 1.0, "Dirichlet concentration (partition = dirichlet)"),
        Param("nodes", Interval(int, 1, 100_000), 25, "nodes in the federation"),
        Param("byzantine", Interval(int, 0, None), 5, "Byzantine nodes among them"),
        Param("tolerate", Interval(int, 0, None), None,
              "the f the defence assumes (default: byzantine; robust bench --tune may choose another)"),
        Param("seeds", RUN["seed"].rule, [0], "run seeds (a grid axis)"),
        Param("aggregators", Spec(lambda spec: aggregators.build(spec, 0), "an aggregator spec"), ["mean"],
              "aggregator specs (a grid axis)"),
        Param("attacks", Spec(lambda spec: attacks.build(spec, 1), "an attack spec"), ["none"],
              "attack specs (a grid axis)"),
        Param("faults", Spec(build_faults, "a fault spec: none, link-down:node=1,after=30,seconds=20, "
                             "slow-link:node=1,after=30,seconds=60,factor=0.01, restart:node=1,after=30"), "none",
              "faults on volunteers' real links, joined by + (robust field only: evaluation.field.lab.wire_faults)"),
        Param("profiles", Spec(check_profile, "a compute profile: cpu, cpu:isa=default|avx2|avx512 or cuda"), "cpu",
              "the volunteers' compute profiles, a list given to the nodes in turn (cpu: this machine's best level; "
              "--engine deploy runs each volunteer's processes at its own)"),
        Param("deadline", Interval(float, 0, None), 0.0,
              "simulated seconds a synchronous round waits for replies (0: for every node asked)"),
        Param("target", Interval(float, 0, 1, "right"), 0.95,
              "the bar to reach, x the best clean final accuracy of the cells that differ only in how updates "
              "travel (evaluation.reports.target_costs)"),
        Param("target-of", OneOf(OF), "best",
              "what target multiplies: the best clean final accuracy of those cells, or the baseline's among them "
              "(momentum, float32 both ways), for a task whose best bar the baseline never reaches"),
        Param("target-accuracy", Interval(float, 0, 1), 0.0,
              "an absolute accuracy to reach instead (0: target x the best clean one); each cell then records "
              "what reaching it cost"),
        Param("target-loss", Interval(float, 0, None), 0.0,
              "text sets (the report ranks by held-out loss): an absolute held-out loss to reach, nats per byte "
              "(0: the best clean final loss / target)"),
    ),
    **CLOCK,
}
AXES = ("seeds", "aggregators", "attacks")
# Keys whose value may be a list given to the nodes in turn (node i, in sorted id order, gets
# item i mod its length): such a list is one value; a list of them is a grid axis.
PER_NODE = ("link", "profiles")
DEFAULTS = {k: p.default for k, p in SCENARIO.items()}


def load_scenario(path: str | None, overrides: list[str] = (), engine: str = "local") -> dict:
    """Defaults, then the file's ``[scenario]`` table, then ``--set`` overrides; validated
    (for ``engine``: ``deploy`` and ``field`` play node-side attacks only; only ``field`` plays
    ``faults``)."""
    scenario, given = dict(DEFAULTS), set()
    if path:
        try:
            table_ = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"scenario file {path} not found: pass an existing --config") from None
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML ({err})") from None
        if "scenario" not in table_:
            raise ValueError(f"{path} has no [scenario] table: put the settings under [scenario]")
        scenario.update(table_["scenario"])
        given.update(table_["scenario"])
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item!r}: write key=value, e.g. --set rounds=20")
        try:
            scenario[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            scenario[key.strip()] = raw  # a bare word such as --set dataset=mnist1d
        given.add(key.strip())
    scenario.update(model_defaults(scenario["model"], given))
    validate(scenario, engine)
    return scenario


def model_defaults(model: object, given: set[str]) -> dict:
    """What the scenario's model trains with where the scenario does not say
    (``robust.models.training_defaults``: a language model's local AdamW). A model axis whose
    models train differently by default must say it (``ValueError``)."""
    from robust.models import training_defaults

    models = [str(m) for m in model] if isinstance(model, list) else [str(model)]
    implied = [training_defaults(m) for m in models]
    chosen = {}
    for key in sorted({k for d in implied for k in d} - given):
        values = [d.get(key, DEFAULTS[key]) for d in implied]
        if len(set(map(repr, values))) > 1:
            raise ValueError(f"models {' and '.join(models)} train with different {key} by default "
                             f"({' and '.join(map(str, values))}): set {key} in the scenario")
        chosen[key] = values[0]
    return chosen


def validate(scenario: dict, engine: str = "local") -> None:
    """Refuse unknown keys and impossible values before any cell runs, in one line each."""
    unknown(scenario, SCENARIO, "scenario")
    for key, value in scenario.items():
        axis = is_axis(key, value)
        values = value if axis else [value]
        if not values:
            raise ValueError(f"{key} is an empty list: give at least one value")
        checked = [checked_value(key, v) for v in values]
        scenario[key] = checked if axis or key in AXES else checked[0]
    for config in grid(scenario):
        n, f = config["nodes"], config["byzantine"]
        if f >= n:
            raise ValueError(f"byzantine must be below nodes (got byzantine={f}, nodes={n})")
        timed = config.get("round") == "async" or config.get("deadline")
        if engine == "flower" and timed and (not config.get("step-seconds") or config.get("churn", "none") != "none"):
            raise ValueError("--engine flower plays a schedule (round=async or a deadline) on the local driver's "
                             "simulated clock: give step-seconds (e.g. step-seconds=0.01) and no churn, or run "
                             "--engine local")
        profiles = config.get("profiles", "cpu")
        if engine != "deploy" and set(profiles if isinstance(profiles, list) else [profiles]) != {"cpu"}:
            raise ValueError(f"profiles = {profiles!r} runs each volunteer at its own level, in processes of its own: "
                             "run it with --engine deploy, or drop it (profiles = \"cpu\")")
        if engine == "local" and config.get("referee-profile", "cpu") != "cpu":
            raise ValueError(f"referee-profile = {config['referee-profile']!r} is the coordinator's: run it with "
                             "--engine deploy or flower, or drop it (referee-profile = \"cpu\")")
        if engine != "field" and config.get("faults", "none") != "none":
            raise ValueError(f"faults = {config['faults']!r} are played on real links by robust field: "
                             "drop them here (faults = \"none\")")
        if config["quorum"] > n:
            raise ValueError(f"quorum={config['quorum']} is above nodes={n}: no round could step; lower quorum")
        for spec in scenario["aggregators"]:
            aggregators.build(spec, f if config.get("tolerate") is None else config["tolerate"]).check_n(n)
            cell_settings(Cell(config, spec, "none", scenario["seeds"][0]))
    for spec in scenario["attacks"]:
        attack = attacks.build(spec, 1)
        if engine in ("deploy", "field") and isinstance(attack, OmniscientAttack) and attack.name != "none":
            raise ValueError(f"{'--engine deploy' if engine == 'deploy' else 'robust field'} plays node-side attacks "
                             f"only (label-flip, backdoor): {spec!r} is "
                             "omniscient (it needs every node's update); run it with --engine local or flower")


def is_axis(key: str, value: object) -> bool:
    """Whether ``value`` of ``key`` spans a grid axis: a list, but for a :data:`PER_NODE` key
    only a list of lists (a list of specs is that key's one per-node value)."""
    if key in PER_NODE:
        return isinstance(value, list) and bool(value) and all(isinstance(v, list) for v in value)
    return isinstance(value, list)


def checked_value(key: str, value: object) -> object:
    """One value of ``key`` checked against its declared rule (a per-node list item by item)."""
    if key in PER_NODE and isinstance(value, list):
        if not value:
            raise ValueError(f"{key} is an empty list: give at least one spec, or a list of specs the nodes take in turn")
        return [check_all("scenario", {key: SCENARIO[key]}, {key: v})[key] for v in value]
    return check_all("scenario", {key: SCENARIO[key]}, {key: value})[key]


def grid(scenario: dict) -> list[dict]:
    """One config per combination of the non-axis keys' grid values."""
    keys = [k for k in scenario if k not in AXES]
    values = [v if is_axis(k, v) else [v] for k, v in ((k, scenario[k]) for k in keys)]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def cells(scenario: dict, sweep: str | None = None, points: int = 8) -> list[Cell]:
    """Every cell of the grid; with ``sweep`` ('alie:z=0.1..3'), the swept attack replaces
    the scenario's attacks (clean 'none' cells are kept as the reference)."""
    attack_specs = [(a, None) for a in scenario["attacks"]]
    if sweep:
        attack_specs = [("none", None), *sweep_specs(sweep, points)]
    return [
        Cell(config, agg, attack, int(seed), info)
        for config in grid(scenario)
        for agg in scenario["aggregators"]
        for attack, info in attack_specs
        for seed in scenario["seeds"]
    ]


def sweep_specs(sweep: str, points: int) -> list[tuple[str, dict]]:
    """``alie:z=0.1..3`` -> ``points`` attack specs with z evenly spaced from 0.1 to 3. Any
    parameter of any attack can be swept; the attack's other parameters may be fixed
    (``evade:detector=all,dir=alie,max=0.5..4``); an integer parameter takes the distinct
    whole values of the range."""
    example = "e.g. alie:z=0.1..3, or evade:detector=all,dir=ipm,max=0.5..4"
    comps = parse(sweep.replace("..", "~"))
    ranged = [k for k, v in comps[0].params.items() if "~" in str(v)] if len(comps) == 1 else []
    if len(ranged) != 1:
        raise ValueError(f"--sweep {sweep!r}: write one attack with one range LOW..HIGH, {example}")
    param, name, fixed = ranged[0], comps[0].name, {k: v for k, v in comps[0].params.items() if k != ranged[0]}
    lo, _, hi = str(comps[0].params[param]).partition("~")
    try:
        lo_v, hi_v = float(lo), float(hi)
    except ValueError:
        raise ValueError(f"--sweep {sweep!r}: the range must be LOW..HIGH, {example}") from None
    if points < 2:
        raise ValueError(f"--sweep {sweep!r}: --sweep-points must be >= 2")
    declared = attacks.REGISTRY.lookup(name, sweep).declared().get(param)
    values = np.linspace(lo_v, hi_v, points).tolist()
    if declared is not None and declared.kind is int:
        values = sorted({round(v) for v in values})
    out = []
    for v in values:
        spec = f"{format_spec([Component(name, fixed)])}{',' if fixed else ':'}{param}={v:.6g}"
        attacks.build(spec, 1)  # fail early on a bad name or parameter
        out.append((spec, {"attack": name, "param": param, "value": v}))
    return out


def cell_id(cell: Cell) -> str:
    """A stable id of the cell's inputs: re-runs skip cells whose id is already in results."""
    key = json.dumps(
        {"config": cell.config, "aggregator": cell.aggregator, "attack": cell.attack, "seed": cell.seed},
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]
