"""Scenario files: a TOML ``[scenario]`` table whose list values expand to a grid of cells.

``seeds``, ``aggregators`` and ``attacks`` are lists by nature; any other key given a list
(``alpha = [0.1, 1.0]``) becomes one more axis of the grid. ``--set key=value`` overrides a
key from the command line (``value`` in TOML syntax: ``--set rounds=20``,
``--set 'attacks=["none","alie"]'``).
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
from robust.data import names as dataset_names
from robust.models import MODELS
from robust.spec import parse

from .engine import Cell

DEFAULTS: dict = {
    "dataset": "digits", "partition": "iid", "alpha": 1.0, "model": "mlp", "nodes": 25,
    "byzantine": 5, "rounds": 50, "batch-size": 32, "lr": 0.05, "momentum": 0.9,
    "local-steps": 1, "seeds": [0], "aggregators": ["mean"], "attacks": ["none"],
}
AXES = ("seeds", "aggregators", "attacks")


def load_scenario(path: str | None, overrides: list[str] = ()) -> dict:
    """Defaults, then the file's ``[scenario]`` table, then ``--set`` overrides; validated."""
    scenario = dict(DEFAULTS)
    if path:
        try:
            table = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"scenario file {path} not found: pass an existing --config") from None
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML ({err})") from None
        if "scenario" not in table:
            raise ValueError(f"{path} has no [scenario] table: put the settings under [scenario]")
        scenario.update(table["scenario"])
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item!r}: write key=value, e.g. --set rounds=20")
        try:
            scenario[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            scenario[key.strip()] = raw  # a bare word such as --set dataset=mnist1d
    validate(scenario)
    return scenario


def validate(scenario: dict) -> None:
    """Refuse unknown keys and impossible values before any cell runs."""
    unknown = set(scenario) - set(DEFAULTS) - {"data-root", "max-norm"}
    if unknown:
        raise ValueError(f"unknown scenario keys {sorted(unknown)}: known keys are {sorted(DEFAULTS)}")
    for axis in AXES:
        if not isinstance(scenario[axis], list) or not scenario[axis]:
            scenario[axis] = [scenario[axis]]
    for config in grid(scenario):
        if config["dataset"] not in dataset_names():
            raise ValueError(f"unknown dataset {config['dataset']!r}: choose from {', '.join(dataset_names())}")
        if config["model"] not in MODELS:
            raise ValueError(f"unknown model {config['model']!r}: choose from {', '.join(MODELS)}")
        n, f = int(config["nodes"]), int(config["byzantine"])
        if not 0 <= f < n:
            raise ValueError(f"byzantine must be in [0, nodes) (got byzantine={f}, nodes={n})")
        for spec in scenario["aggregators"]:
            aggregators.build(spec, f).check_n(n)
        for spec in scenario["attacks"]:
            attacks.build(spec, f)


def grid(scenario: dict) -> list[dict]:
    """One config per combination of the list-valued non-axis keys."""
    keys = [k for k in scenario if k not in AXES]
    values = [v if isinstance(v, list) else [v] for v in (scenario[k] for k in keys)]
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
    """``alie:z=0.1..3`` -> ``points`` attack specs with z evenly spaced from 0.1 to 3."""
    comps = parse(sweep.replace("..", "~"))
    if len(comps) != 1 or len(comps[0].params) != 1:
        raise ValueError(f"--sweep {sweep!r}: write one attack and one range, e.g. alie:z=0.1..3")
    (param, text), = comps[0].params.items()
    lo, sep, hi = str(text).partition("~")
    try:
        lo_v, hi_v = float(lo), float(hi)
    except ValueError:
        raise ValueError(f"--sweep {sweep!r}: the range must be LOW..HIGH, e.g. z=0.1..3") from None
    if not sep or points < 2:
        raise ValueError(f"--sweep {sweep!r}: the range must be LOW..HIGH with --sweep-points >= 2")
    name = comps[0].name
    out = []
    for v in np.linspace(lo_v, hi_v, points).tolist():
        spec = f"{name}:{param}={v:.6g}"
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
