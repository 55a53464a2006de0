"""The tree's import graph (DESIGN, "Layout"): no cycle, and every dependency points one way.

Every ``.py`` file under ``aggregators/ attacks/ robust/ nodes/ evaluation/`` is parsed (never
imported) and each ``import`` becomes an edge from its module to the tree's module it names,
relative imports resolved. Imports inside functions count as much as those at the top: a lazy
import is a dependency too, only a later one, and a cycle through it still ties the modules
together. Two kinds of edge are left out, on purpose: a module's parent packages (Python
imports them implicitly; a registry's ``__init__`` that imports its own rules is no cycle), and
names that are not the tree's (``torch``, ``flwr``: checked only where a rule names them).

The directions checked:

- packages: ``evaluation -> nodes -> attacks, aggregators -> robust``; ``robust`` imports none
  of the others except its two entry points, which dispatch lazily (inside functions);
  nothing outside ``evaluation`` imports it; aggregators and attacks never import Flower;
- inside ``nodes``: the engine (``nodes.engine``) imports only itself and the shared wire
  format and atomic writes; the coordinator's and the volunteer's sides use the engine and
  the shared modules, and never reach each other, not even through a shared module.

And the rooms: ``evaluation/`` is in sub-packages by role, with at most :data:`TOP_MODULES`
modules at its top (its ``__init__`` and the thin entry modules of the measurement commands);
no two modules or packages of the tree have one name (see :func:`ambiguous_names`), except the
pairs :data:`SAME_NAME` lists with their reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("aggregators", "attacks", "robust", "nodes", "evaluation")

# Package direction: what each top-level package may import (besides itself).
MAY_IMPORT = {
    "evaluation": {"nodes", "attacks", "aggregators", "robust"},
    "nodes": {"attacks", "aggregators", "robust"},
    "attacks": {"robust"},
    "aggregators": {"robust"},
    "robust": set(),
}
# robust's entry points, which dispatch to the packages above it: allowed by name, only from
# inside a function, so that importing robust (and `robust --help`) imports none of them.
LAZY_DISPATCH = {"robust.cli", "robust.flower"}

# Inside nodes: what each group may import (besides itself). The shared modules at the top of
# `nodes/` are in two layers: the wire format and atomic writes under the engine, the
# settings (validated with the engine's protocol and staleness rules), code trust and the
# launchers above it.
BOTTOM = {"nodes.wire", "nodes.checkpoint"}
SHARED = BOTTOM | {"nodes.settings", "nodes.codetrust", "nodes.launch", "nodes.inflate"}
NODES_MAY_IMPORT = {
    "nodes.engine": BOTTOM,
    "nodes.wire": BOTTOM,
    "nodes.checkpoint": BOTTOM,
    "nodes.codetrust": set(),
    "nodes.inflate": set(),  # Flower's arrays assembled once: a volunteer's ClientApp and the ServerApp
    "nodes.launch": {"nodes.codetrust"},
    "nodes.settings": {"nodes.engine"},
    "nodes.coordinator": {"nodes.engine"} | SHARED,
    "nodes.volunteer": {"nodes.engine"} | SHARED,
    "nodes.strategy": {"nodes.engine"} | SHARED,
    "nodes.reference": {"nodes.engine"} | SHARED,  # the parameter reference, for the manual
    # the coordinator's web page: reads its folder, as the coordinator's status does
    "nodes.dashboard": {"nodes.engine", "nodes.coordinator"} | SHARED,
    # the CLI dispatches to both sides
    "nodes.cli": {"nodes.engine", "nodes.coordinator", "nodes.volunteer", "nodes.commands", "nodes.demo",
                  "nodes.dashboard"} | SHARED,
    "nodes.commands": {"nodes.engine", "nodes.coordinator", "nodes.volunteer", "nodes.dashboard"} | SHARED,
    "nodes.demo": {"nodes.engine", "nodes.coordinator", "nodes.volunteer", "nodes.commands", "nodes.dashboard"} | SHARED,
}
SIDES = ("nodes.coordinator", "nodes.volunteer")

# evaluation/'s top: its __init__ and the measurement commands' thin entry modules
# (``python -m evaluation.hand_loop`` ...); everything else lives in a sub-package by role.
TOP_MODULES = 10
# Names that several modules of the tree may share, each with the exact files and why: one
# family's part in each registry package, the same role at each place, never two meanings.
SAME_NAME = {
    "base": ({"aggregators/base.py", "attacks/base.py", "robust/codecs/base.py"},
             "each registry's base class and its own registry (rules, attacks, codecs)"),
    "none": ({"attacks/none.py", "robust/codecs/none.py"},
             "a registry's do-nothing member: the attack `none`, the codec `none`"),
    "cli": ({"robust/cli.py", "nodes/cli.py"},
            "the `robust` command; robust.cli dispatches its node subcommands to nodes.cli"),
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a module of the tree, or the absolute name imported (outside the tree)
    line: int
    lazy: bool  # inside a function
    internal: bool

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}{', in a function' if self.lazy else ''})"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module under the tree's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _in_tree(name: str, known: dict) -> str | None:
    """The longest prefix of ``name`` that is a module of the tree."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(root: Path) -> list[Edge]:
    """Every import of every module of the tree."""
    known = modules(root)
    out = []
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]

        def add(target: str, node: ast.AST, lazy: bool) -> None:
            inside = _in_tree(target, known)
            out.append(Edge(name, inside or target, node.lineno, lazy, inside is not None))

        def visit(node: ast.AST, lazy: bool) -> None:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node, lazy)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module
                for alias in node.names:  # `from pkg import module` depends on the module itself
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, node, lazy)
            inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(ast.parse(path.read_text(), str(path)), False)
    return out


def graph(found: list[Edge]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for e in found:
        g.setdefault(e.source, set())
        if e.internal and e.target != e.source:
            g[e.source].add(e.target)
    return g


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(g):
        if start in state:
            continue
        path, todo = [start], [iter(sorted(g.get(start, ())))]
        state[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(sorted(g.get(nxt, ()))))
    return None


def path_to(g: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """A shortest import path from ``start`` to a module for which ``goal`` holds."""
    seen, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(g.get(m, ())):
                if t not in seen:
                    seen[t] = seen[m] + [t]
                    if goal(t):
                        return seen[t]
                    nxt.append(t)
        frontier = nxt
    return None


def group(module: str, groups) -> str | None:
    """The first of ``groups`` that is ``module`` or one of its packages."""
    return next((g for g in groups if module == g or module.startswith(g + ".")), None)


def direction_violations(found: list[Edge]) -> list[str]:
    bad = []
    for e in found:
        if not e.internal:
            continue
        src, dst = e.source.split(".")[0], e.target.split(".")[0]
        if src == dst or dst in MAY_IMPORT[src]:
            continue
        if e.source in LAZY_DISPATCH and e.lazy:
            continue
        bad.append(str(e))
    return bad


def nodes_violations(found: list[Edge]) -> list[str]:
    bad = []
    for e in found:
        if not (e.internal and e.source.startswith("nodes.") and e.target.startswith("nodes.")):
            continue
        src, dst = group(e.source, NODES_MAY_IMPORT), group(e.target, NODES_MAY_IMPORT)
        if src is None or dst is None:
            bad.append(f"{e}: a module of nodes/ in no group of this test (add it to NODES_MAY_IMPORT)")
        elif src != dst and dst not in NODES_MAY_IMPORT[src]:
            bad.append(str(e))
    return bad


def sides_reaching(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for module in sorted(g):
        side = group(module, SIDES)
        if side is None:
            continue
        other = next(s for s in SIDES if s != side)
        found = path_to(g, module, lambda m: group(m, (other,)) is not None)
        if found:
            bad.append(" -> ".join(found))
    return bad


def flower_in(found: list[Edge], packages: tuple[str, ...]) -> list[str]:
    return [str(e) for e in found
            if e.source.split(".")[0] in packages and not e.internal and e.target.split(".")[0] == "flwr"]


def top_modules(root: Path, package: str) -> list[str]:
    """The ``.py`` files directly in ``package`` (its ``__init__`` included)."""
    return sorted(path.name for path in (root / package).glob("*.py"))


def _name_key(name: str) -> str:
    """What two names are compared by: case and one trailing ``s`` ignored (``clock``, ``clocks``)."""
    name = name.lower()
    return name[:-1] if name.endswith("s") else name


def ambiguous_names(root: Path, allowed: dict = SAME_NAME) -> list[str]:
    """Groups of modules and packages of the tree that share a name.

    Every module (``.py`` file but ``__init__``) and every package (a folder with an
    ``__init__.py``) under the tree's packages is named by its file or folder name; two are
    ambiguous when their names are equal once case and one trailing ``s`` are ignored
    (``clock.py`` beside ``clocks.py``, ``report.py`` in two places, a module named as a
    package elsewhere). A module may share its own package's name (``nodes/engine/engine.py``:
    the package's main module). A group is allowed only when it is exactly the files
    ``allowed`` lists for that name."""
    by_name: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "__init__.py":
                where, name = path.parent, path.parent.name
            else:
                where, name = path, path.stem
                if (path.parent / "__init__.py").exists() and _name_key(path.stem) == _name_key(path.parent.name):
                    continue  # a package's own main module
            if not (where.parent / "__init__.py").exists() and where.parent != root:
                continue  # not importable as a module of the tree (a data folder's script)
            by_name.setdefault(_name_key(name), set()).add(where.relative_to(root).as_posix())
    bad = []
    for key, paths in sorted(by_name.items()):
        if len(paths) > 1 and not any(paths == files for files, _ in
                                      [allowed[k] for k in allowed if _name_key(k) == key]):
            bad.append(f"{key}: " + ", ".join(sorted(paths)))
    return bad


# --- the tree -------------------------------------------------------------------------------

FOUND = edges(ROOT)
GRAPH = graph(FOUND)


def test_the_whole_tree_is_read():
    names = modules(ROOT)
    assert len(names) > 100 and {"nodes.engine.engine", "nodes.coordinator.coordinator", "nodes.volunteer.volunteer",
                                 "aggregators.krum", "evaluation.bench.drivers.inprocess", "robust.cli"} <= set(names)
    # resolved edges the checks rely on: relative (one and two levels), absolute, lazy
    seen = {(e.source, e.target, e.lazy) for e in FOUND}
    assert ("nodes.coordinator.verifier", "nodes.engine.training", False) in seen
    assert ("nodes.coordinator.coordinator", "nodes.checkpoint", False) in seen  # from .. import checkpoint
    assert ("nodes.engine.engine", "nodes.engine.ledger", False) in seen
    assert ("evaluation.bench.drivers.inprocess", "nodes.engine.engine", False) in seen
    assert ("robust.cli", "nodes.cli", True) in seen
    assert ("nodes.settings", "nodes.engine.protocol", True) in seen


def test_no_import_cycle_anywhere():
    found = cycle(GRAPH)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_packages_point_one_way():
    assert direction_violations(FOUND) == [], (
        "evaluation -> nodes -> attacks, aggregators -> robust (robust.cli and robust.flower only from "
        "inside a function):\n" + "\n".join(direction_violations(FOUND)))


def test_only_the_two_entry_points_of_robust_import_upward():
    # the design's two lazy exceptions, by name, and no other: a third needs the design changed
    assert LAZY_DISPATCH == {"robust.cli", "robust.flower"}
    assert {e.source for e in FOUND if e.internal and e.source.startswith("robust.")
            and e.target.split(".")[0] != "robust"} <= LAZY_DISPATCH


def test_evaluation_is_in_rooms_by_role():
    top = top_modules(ROOT, "evaluation")
    assert len(top) <= TOP_MODULES, f"{len(top)} modules at evaluation/'s top (at most {TOP_MODULES}): {top}"
    # the measurement commands people and the docs name keep working under these names
    assert {"hand_loop.py", "large_model.py", "spot_tolerance.py", "device_speed.py", "flower_memory.py"} <= set(top)


def test_no_two_modules_share_a_name():
    assert ambiguous_names(ROOT) == [], (
        "modules or packages of one name (rename one for what it holds, or list the pair in SAME_NAME with "
        "its reason):\n" + "\n".join(ambiguous_names(ROOT)))


def test_aggregators_and_attacks_never_import_flower():
    assert flower_in(FOUND, ("aggregators", "attacks")) == []


def test_the_engine_imports_no_side_and_the_shared_modules_no_side():
    assert nodes_violations(FOUND) == [], "\n".join(nodes_violations(FOUND))


def test_the_coordinator_and_the_volunteer_never_reach_each_other():
    assert sides_reaching(GRAPH) == [], "\n".join(sides_reaching(GRAPH))


# --- the checks themselves can fail --------------------------------------------------------


def test_each_check_catches_what_it_is_for(tmp_path):
    files = {
        "robust/__init__.py": "",
        "robust/cli.py": "import nodes.cli\n\ndef main():\n    import evaluation\n",  # module-level: refused
        "robust/flower.py": "def make():\n    from nodes.strategy import X\n",  # lazy dispatch: allowed
        "aggregators/__init__.py": "from . import krum\n",  # a registry: not a cycle with krum's `from .base`
        "aggregators/base.py": "",
        "aggregators/krum.py": "from .base import x\nimport flwr\n",
        "attacks/__init__.py": "",
        "nodes/__init__.py": "",
        "nodes/cli.py": "",
        "nodes/strategy.py": "",
        "nodes/wire.py": "",
        "nodes/launch.py": "from .volunteer import client_app\n",
        "nodes/engine/__init__.py": "",
        "nodes/engine/ledger.py": "from . import rows\n",
        "nodes/engine/rows.py": "def f():\n    from ..engine.ledger import Ticket\n",  # a cycle through a lazy import
        "nodes/coordinator/__init__.py": "",
        "nodes/coordinator/status.py": "from .. import launch\nfrom ..wire import x\n",
        "nodes/volunteer/__init__.py": "",
        "nodes/coordinator/audit.py": "",
        "nodes/volunteer/client_app.py": "from ..coordinator.audit import y\n",
        "evaluation/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = edges(tmp_path)
    g = graph(found)
    assert cycle(g) in (["nodes.engine.ledger", "nodes.engine.rows", "nodes.engine.ledger"],
                        ["nodes.engine.rows", "nodes.engine.ledger", "nodes.engine.rows"])
    assert direction_violations(found) == ["robust.cli -> nodes.cli (line 1)"]
    assert flower_in(found, ("aggregators", "attacks")) == ["aggregators.krum -> flwr (line 2)"]
    assert nodes_violations(found) == ["nodes.launch -> nodes.volunteer.client_app (line 1)",
                                       "nodes.volunteer.client_app -> nodes.coordinator.audit (line 1)"]
    assert sides_reaching(g) == ["nodes.coordinator.status -> nodes.launch -> nodes.volunteer.client_app",
                                 "nodes.volunteer.client_app -> nodes.coordinator.audit"]


def test_the_room_checks_catch_what_they_are_for(tmp_path):
    def write(name: str, text: str = "") -> None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    for package in PACKAGES:
        write(f"{package}/__init__.py")
    for i in range(TOP_MODULES - 1):
        write(f"evaluation/entry_{i}.py")
    write("evaluation/bench/__init__.py")
    write("evaluation/bench/bench.py")  # a package's own module: no ambiguity
    write("evaluation/probe/sitecustomize.py")  # a data folder's script: not a module of the tree
    write("nodes/engine/__init__.py")
    write("nodes/engine/clocks.py")
    write("aggregators/base.py")
    write("attacks/base.py")
    assert len(top_modules(tmp_path, "evaluation")) == TOP_MODULES
    assert ambiguous_names(tmp_path) == ["base: aggregators/base.py, attacks/base.py"]  # not SAME_NAME's three
    assert ambiguous_names(tmp_path, {"base": ({"aggregators/base.py", "attacks/base.py"}, "a reason")}) == []

    write("evaluation/one_too_many.py")
    assert len(top_modules(tmp_path, "evaluation")) == TOP_MODULES + 1
    write("evaluation/simtime/__init__.py")
    write("evaluation/simtime/clock.py")  # beside nodes/engine/clocks.py
    write("evaluation/reports/__init__.py")
    write("evaluation/reports/Bench.py")  # the name of a package elsewhere
    assert ambiguous_names(tmp_path, {}) == [
        "base: aggregators/base.py, attacks/base.py",
        "bench: evaluation/bench, evaluation/reports/Bench.py",
        "clock: evaluation/simtime/clock.py, nodes/engine/clocks.py",
    ]
