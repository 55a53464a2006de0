"""The common parameter checks (after scikit-learn's ``check_estimator``): every parameter of
every registered component, fed bad values through every door, gives one line that names the
component, the key and what is allowed; and no component checks a parameter by hand.

The families: rules and pre-aggregators, attacks, codecs, the bench's volunteer traits (speed,
link, churn), protocols, staleness weights (spec families, one component per name), and the
coordinator settings and scenario keys (tables). For each parameter: a wrong type, a value out
of its range (where the rule has one), an unknown key and a malformed spec, through Python (the
family's ``build``), a scenario file, and ``robust.cli.main`` in process (exit 2, one line on
stderr, no traceback); then one real ``python -m robust.cli`` per family.
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import aggregators
import attacks
from evaluation.field.lab import wire_faults as faults
from evaluation.simtime import traits
from evaluation.bench.scenario import SCENARIO, load_scenario
from nodes.engine import protocol, staleness
from nodes.settings import PARAMS as SETTINGS, Settings
from robust import codecs
from robust.cli import main
from robust.constraints import Flag, Folder, Host, Interval, OneOf, Param, Spec, Text
from robust.registry import Component, Registry
from robust.spec import parse

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Family:
    """A spec family: its components' names and declarations, how Python builds a spec, and
    the scenario key that takes one (a list for the grid's axes)."""

    family: str
    declared: dict[str, dict[str, Param]]  # name -> its parameters
    build: object
    key: str
    axis: bool = False
    after: dict[str, str] = field(default_factory=dict)  # what a spec needs after a component (a rule)

    def spec(self, name: str, params: str) -> str:
        return f"{name}:{params}{self.after.get(name, '')}"


REGISTRIES = (aggregators.REGISTRY, attacks.REGISTRY, codecs.REGISTRY,
              traits.SPEEDS, traits.LINKS, traits.CHURNS, faults.FAULTS)


def of(registry: Registry) -> dict[str, dict[str, Param]]:
    return {name: cls.declared() for name, cls in sorted(registry.entries.items())}


PRE = {name: "+mean" for name in aggregators.pre_aggregators()}  # a chain ends with a rule
FAMILIES = [
    Family("aggregator", of(aggregators.REGISTRY), lambda spec: aggregators.build(spec, 0), "aggregators", True, PRE),
    Family("attack", of(attacks.REGISTRY), lambda spec: attacks.build(spec, 1), "attacks", True),
    Family("codec", of(codecs.REGISTRY), codecs.build, "compression"),
    Family("speed", of(traits.SPEEDS), traits.build_speed, "speed"),
    Family("link", of(traits.LINKS), traits.build_link, "link"),
    Family("churn", of(traits.CHURNS), traits.build_churn, "churn"),
    Family("fault", of(faults.FAULTS), faults.build_faults, "faults"),
    Family("protocol", protocol.PARAMS,
           lambda spec: protocol.Protocol.parse(spec, lr=0.1, momentum=0.0, batch_size=1), "protocol"),
    Family("staleness", staleness.PARAMS, staleness.weight_of, "staleness"),
]
CASES = [(fam, name, p) for fam in FAMILIES for name, params in fam.declared.items() for p in params.values()]
COMPONENTS = [(fam, name) for fam in FAMILIES for name in fam.declared]


def wrong_type(rule) -> object:
    """A value of the wrong type for ``rule``, as a spec writes it."""
    if isinstance(rule, Interval):
        return 1.5 if rule.kind is int else "abc"
    return "yes" if isinstance(rule, Flag) else 3


def out_of_range(rule) -> object | None:
    """A value of the right type outside ``rule``'s range (``None``: the rule has none)."""
    if isinstance(rule, Interval):
        return rule.low - 1 if rule.low is not None else rule.high + 1 if rule.high is not None else None
    if isinstance(rule, OneOf):
        return "no-such-choice"
    return {Host: "bad host", Folder: "/no/such/folder"}.get(type(rule))


def bad_values(p: Param) -> list[object]:
    return [v for v in (wrong_type(p.rule), out_of_range(p.rule)) if v is not None]


def said(where: str, p: Param, value: object) -> str:
    """The one line every bad value gets."""
    return f"{where}: {p.key} must be {p.rule.describe()} (got {p.key}={value!r})"


def refusal(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


def scenario_file(tmp_path: Path, key: str, value: object) -> str:
    path = tmp_path / "scenario.toml"
    path.write_text(f"[scenario]\n{key} = {json.dumps(value)}\n")
    return str(path)


def cli(capsys, *argv: str) -> str:
    """The one line ``robust`` writes on stderr for a usage error (exit 2, no traceback)."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.rstrip("\n")


def every_door(fam: Family, spec: str, tmp_path: Path, capsys) -> list[str]:
    """What a bad ``spec`` of ``fam`` gets from Python, from a scenario file and from the CLI,
    each without its door's own prefix."""
    value = [spec] if fam.axis else spec
    prefix = f"scenario: {fam.key}: "
    from_file = refusal(lambda: load_scenario(scenario_file(tmp_path, fam.key, value)))
    from_cli = cli(capsys, "bench", "--out", str(tmp_path / "out"), "--set", f"{fam.key}={json.dumps(value)}")
    assert from_file.startswith(prefix) and from_cli.startswith("robust bench: error: " + prefix)
    return [refusal(lambda: fam.build(spec)), from_file.removeprefix(prefix),
            from_cli.removeprefix("robust bench: error: " + prefix)]


@pytest.mark.parametrize("fam, name, p", CASES, ids=[f"{f.family}-{n}-{p.key}" for f, n, p in CASES])
def test_a_bad_value_of_any_parameter_is_one_line_naming_it(fam, name, p, tmp_path, capsys):
    for bad in bad_values(p):
        spec = fam.spec(name, f"{p.key}={bad}")
        given = parse(spec)[0].params[p.key]  # the value as the spec grammar reads it
        for line in every_door(fam, spec, tmp_path, capsys):
            assert line == said(name, p, given), (spec, line)


@pytest.mark.parametrize("fam, name", COMPONENTS, ids=[f"{f.family}-{n}" for f, n in COMPONENTS])
def test_an_unknown_key_and_a_malformed_spec_are_one_line_naming_them(fam, name, tmp_path, capsys):
    known = ", ".join(sorted(fam.declared[name])) or "none"
    for line in every_door(fam, fam.spec(name, "zzz=1"), tmp_path, capsys):
        assert line == f"{name}: unknown key zzz (known: {known})"
    for key in fam.declared[name]:
        for line in every_door(fam, fam.spec(name, key), tmp_path, capsys):
            assert f"bad parameter '{key}' of '{name}'" in line and "write key=value" in line, line


SETTING_CASES = [(p, bad) for p in SETTINGS.values() for bad in bad_values(p)]


@pytest.mark.parametrize("p, bad", SETTING_CASES, ids=[f"{p.key}-{bad!r}" for p, bad in SETTING_CASES])
def test_a_bad_setting_is_one_line_naming_it(p, bad, tmp_path, capsys):
    assert refusal(lambda: Settings().replace(**{p.attr: bad})) == said("settings", p, bad)
    if SCENARIO.get(p.key) is p:  # a run key the scenario shares
        path = scenario_file(tmp_path, p.key, bad)
        assert refusal(lambda: load_scenario(path)) == said("scenario", p, bad)
    if type(bad) is p.kind:
        line = cli(capsys, "coordinator", "init", str(tmp_path / "c"), f"--{p.key}", str(bad))
        assert line == f"robust coordinator: error: {said('settings', p, bad)}"
    elif p.kind not in (str, bool):  # a command line value is text (a flag takes none): converted, or refused in one line
        line = cli(capsys, "coordinator", "init", str(tmp_path / "c"), f"--{p.key}", str(bad))
        assert (line.startswith(f"robust coordinator init: error: argument --{p.key}") and "--help" in line
                or line.startswith(f"robust coordinator: error: settings: {p.key} must be ")), line
    assert not (tmp_path / "c").exists()  # refused before anything is made


SCENARIO_CASES = [(p, bad) for p in SCENARIO.values() if not isinstance(p.rule, Spec) for bad in bad_values(p)]


@pytest.mark.parametrize("p, bad", SCENARIO_CASES, ids=[f"{p.key}-{bad!r}" for p, bad in SCENARIO_CASES])
def test_a_bad_scenario_key_is_one_line_naming_it(p, bad, tmp_path, capsys):
    assert refusal(lambda: load_scenario(scenario_file(tmp_path, p.key, bad))) == said("scenario", p, bad)
    line = cli(capsys, "bench", "--out", str(tmp_path / "out"), "--set", f"{p.key}={json.dumps(bad)}")
    assert line == f"robust bench: error: {said('scenario', p, bad)}"


def test_an_unknown_setting_or_scenario_key_lists_the_known_ones(tmp_path):
    assert refusal(lambda: load_scenario(scenario_file(tmp_path, "zzz", 1))) == \
        f"scenario: unknown key zzz (known: {', '.join(sorted(SCENARIO))})"
    (tmp_path / "coordinator.toml").write_text("zzz = 1\n")
    assert refusal(lambda: Settings.read(tmp_path)) == \
        f"{tmp_path / 'coordinator.toml'}: unknown key zzz (known: {', '.join(sorted(SETTINGS))})"


def first_bad(fam: Family) -> str:
    name, p = next((n, p) for n, params in fam.declared.items() for p in params.values())
    return fam.spec(name, f"{p.key}={wrong_type(p.rule)}")


def test_one_real_robust_process_per_family_exits_2_with_one_line(tmp_path):
    """The installed command, not only ``main``: each family's first parameter given a wrong type
    (staleness rides with the protocols, link and churn with speed: a process costs seconds)."""
    runs = [["bench", "--out", str(tmp_path / fam.family),
             "--set", f"{fam.key}={json.dumps([first_bad(fam)] if fam.axis else first_bad(fam))}"]
            for fam in FAMILIES if fam.family not in ("staleness", "link", "churn")]
    runs.append(["coordinator", "init", str(tmp_path / "c"), "--rounds", "0"])
    procs = [subprocess.Popen([sys.executable, "-m", "robust.cli", *argv], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in runs]
    for argv, proc in zip(runs, procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2 and "Traceback" not in err and err.count("\n") == 1, (argv, err)
        assert " must be " in err and "(got " in err, err


# ------------------------------------------------------------------ nothing bypasses the declarations


REGISTERED = {cls for registry in REGISTRIES for cls in registry.entries.values()}


def classes() -> list[type[Component]]:
    """Every registered component and every class of the project it inherits from."""
    found = {k for cls in REGISTERED for k in cls.__mro__ if issubclass(k, Component) and k is not Component}
    return sorted(found, key=lambda k: (k.__module__, k.__qualname__))


def hand_checks(source: str) -> list[str]:
    """What a class's source does in ``__init__`` that only the declarations may do: take a
    named parameter besides ``f`` (all go through ``**params``), or raise."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            named = [a.arg for a in args.args[2:] + args.kwonlyargs + args.posonlyargs]
            if named or args.vararg:
                found.append(f"__init__ takes {', '.join(named) or '*' + args.vararg.arg} outside the declarations")
            found += [f"__init__ raises (line {r.lineno})" for r in ast.walk(node) if isinstance(r, ast.Raise)]
    return found


def test_the_scan_finds_a_hand_written_check():
    assert hand_checks('''
class Krum:
    def __init__(self, f, *, m=1):
        if m < 1:
            raise ValueError("m must be >= 1")
''') == ["__init__ takes m outside the declarations", "__init__ raises (line 5)"]
    assert hand_checks('''
class Krum:
    def __init__(self, f, **params):
        super().__init__(f, **params)
''') == []


@pytest.mark.parametrize("cls", classes(), ids=lambda k: k.__qualname__)
def test_no_component_checks_a_parameter_by_hand(cls):
    assert hand_checks(inspect.getsource(cls)) == []
    for key, p in cls.declared().items():  # each declared value is the instance's, by its key
        assert not callable(getattr(cls, key, None)), f"{cls.__qualname__}: {key} would hide the method {key}()"
        if cls in REGISTERED:
            assert getattr(cls(1), key) == p.check(p.default)


def test_the_reference_describes_every_declared_parameter():
    from nodes.engine.detectors import DETECTORS
    from nodes.reference import describe

    ref = {(e["family"], e["name"]): e for e in describe()}
    for fam, name, p in CASES:
        if fam.family not in ("speed", "link", "churn", "fault"):  # the bench's: its own Registry.describe()
            assert {"key": p.key, "allowed": p.rule.describe(), "default": p.default, "help": p.help} \
                in ref[fam.family, name]["params"]
    assert [q["key"] for q in ref["settings", "coordinator"]["params"]] == list(SETTINGS)
    assert all(ref["detector", d]["summary"] for d in DETECTORS)
    assert all(e["summary"] and all(q["help"] for q in e["params"]) for e in ref.values())
    assert ref["aggregator", "nnm"]["role"] == "pre-aggregator" and ref["attack", "alie"]["kind"] == "omniscient"
    assert traits.LINKS.describe()[0]["family"] == "link"


def test_the_common_checks_cover_every_component_and_parameter():
    """The counts the report gives; a family whose registry empties fails here, not silently."""
    assert len(COMPONENTS) >= 60 and len(CASES) >= 90
    assert all(isinstance(p.rule, (Interval, OneOf, Flag, Spec, Text, Folder, Host)) for _, _, p in CASES)
