"""The manual (``docs/``, ``mkdocs.yml``): it builds strictly and offline, its reference covers
every registered component and parameter, every command on its getting-started page runs (at a
small size), and the README stays a short front page whose two commands are the ones CI runs.

The strict build needs the ``docs`` extra (``pip install -e '.[docs]'``); without it that test
is skipped, unless ``ROBUST_DOCS=required`` (``.ci/run`` sets it after installing the extra),
where it fails.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GETTING_STARTED = ROOT / "docs" / "getting-started.md"

# How each command of the getting-started page is run. A command is split on ` && `; each part
# must be listed here, so a new command on the page fails this test until it is given a run.
INSTALL = {  # CI runs these itself, on a clean clone: each part -> what .ci/run runs for it
    "python3 -m venv .venv": "python3 -m venv .venv",
    ". .venv/bin/activate": ". .venv/bin/activate",
    "pip install torch==2.13.0": "pip install torch==2.13.0",
    "pip install -e .": "pip install -e '.[docs]'",  # the package, with the docs extra
}
# covered by tests/test_dashboard.py, which runs `robust demo --rounds 4 --seed 3 --json --keep DIR --dashboard
# 127.0.0.1:0` (about a minute of real processes; not run twice): each argument the page gives must be in its argv
DEMO_TEST = ("test_dashboard.py", "test_demo_shows_the_run_live_in_a_browser_and_ends_with_the_in_process_bits")
# run here, with these arguments added (a later --set, --out or --jobs wins): 4 cells of 2 rounds, in
# this process's child alone (--jobs 2's worker processes cost 35 s of start-up on a busy machine;
# tests/test_bench.py runs --jobs 2 and checks it gives --jobs 1's records)
SMALL = {
    "robust bench --config evaluation/scenarios/quick.toml --out out/quick --jobs 2": [
        "--set", "rounds=2", "--set", "seeds=[0]", "--set", 'aggregators=["mean","nnm+trimmed-mean"]',
        "--set", 'attacks=["none","sign-flip"]', "--jobs", "1",
    ],
}


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[str]:
    """Every command of the page's ``bash`` blocks (comments and trailing comments dropped),
    split on ``&&``."""
    out = []
    for block in code_blocks(text, "bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split(" && "))
    return out


def robust_cli() -> list[str]:
    return [sys.executable, "-m", "robust.cli"]


def env() -> dict[str, str]:
    return {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


def demo_test_argv() -> list[str]:
    """The argv (after ``-m robust.cli``) with which the demo test runs ``robust demo``."""
    tree = ast.parse((ROOT / "tests" / DEMO_TEST[0]).read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == DEMO_TEST[1]:
            for node in ast.walk(fn):
                if isinstance(node, ast.List):
                    words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                    if words[:3] == ["-m", "robust.cli", "demo"]:
                        return words[2:]
    raise AssertionError(f"{DEMO_TEST[0]}::{DEMO_TEST[1]} no longer runs `robust demo`: run the "
                         "getting-started page's demo commands here instead")


def test_every_getting_started_command_is_run(tmp_path):
    page = commands(GETTING_STARTED.read_text())
    assert "robust demo" in page and any(c.startswith("robust bench") for c in page)
    unknown = [c for c in page if c not in INSTALL and c not in SMALL and not c.startswith("robust demo")]
    assert not unknown, f"getting-started commands no test runs (add them to tests/test_docs.py): {unknown}"
    ci = (ROOT / ".ci" / "run").read_text()
    for part in INSTALL.keys() & set(page):
        assert re.search(rf"(^|&& ){re.escape(INSTALL[part])}( &&|$)", ci, re.M), f".ci/run no longer runs {INSTALL[part]!r} ({part!r} on the page)"
    demo = demo_test_argv()
    for c in page:
        if c.startswith("robust demo"):
            missing = [a for a in shlex.split(c)[1:] if a not in demo]
            assert not missing, f"{c!r}: {DEMO_TEST[0]} runs `robust {' '.join(demo)}`, without {missing}"
    for c in dict.fromkeys(c for c in page if c in SMALL):  # each once, even when shown twice
        out = tmp_path / "out"
        argv = robust_cli() + shlex.split(c)[1:] + SMALL[c] + ["--out", str(out)]
        done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert (out / "summary.md").exists() and (out / "summary.html").exists()
        assert f"report: {out / 'summary.md'}" in done.stdout


def test_the_readme_is_a_short_front_page_whose_commands_ci_and_the_docs_run():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    first, tests = [c for c in code_blocks(readme, "bash")[0].splitlines() if c and not c.startswith("#")]
    ci = (ROOT / ".ci" / "run").read_text().rstrip().splitlines()
    assert ci[-1] == tests, "CI runs exactly the README's test command, as its last line"
    assert first in code_blocks(GETTING_STARTED.read_text(), "bash")[-1]
    assert tests in (ROOT / "docs" / "about.md").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), f"the README links {link}, which does not exist"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations there
    spec.loader.exec_module(module)
    return module


def test_the_reference_has_every_component_with_its_docstring_and_parameters():
    import aggregators
    import attacks
    from aggregators.base import REGISTRY as STAGES
    from attacks.base import REGISTRY as ATTACKS
    from nodes.engine.detectors import DETECTORS
    from robust.codecs.base import REGISTRY as CODECS

    gen = load_generator()
    pages = gen.pages()
    families = {
        "reference/aggregators.md": {n: STAGES.entries[n] for n in aggregators.rules()},
        "reference/pre-aggregators.md": {n: STAGES.entries[n] for n in aggregators.pre_aggregators()},
        "reference/attacks.md": dict(ATTACKS.entries),
        "reference/codecs.md": dict(CODECS.entries),
    }
    count = 0
    for path, entries in families.items():
        sections = re.split(r"^## ", pages[path], flags=re.M)[1:]
        by_name = {s.split("`")[1]: s for s in sections}
        assert sorted(by_name) == sorted(entries), path
        for name, cls in entries.items():
            section = by_name[name]
            first = sys.modules[cls.__module__].__doc__.strip().splitlines()[0]
            assert gen.docstring_markdown(first).strip() in section, f"{name}: its docstring is not on its page"
            for key, p in cls.declared().items():  # what the code checks (robust.registry)
                count += 1
                row = next((line for line in section.splitlines() if line.startswith(f"| `{key}` |")), None)
                assert row is not None, f"{name}: parameter {key} has no row"
                assert f"`{p.default!r}`" in row and p.rule.describe() in row, f"{name}.{key}: {row!r}"
    assert count > 40  # the components do take parameters: the walk found them
    assert [s.split("`")[1] for s in re.split(r"^## ", pages["reference/detectors.md"], flags=re.M)[1:]] == list(DETECTORS)


def test_a_parameter_table_has_key_type_default_and_the_allowed_range_once_declared():
    gen = load_generator()
    rows = [gen.ParamRow("z", "float or None", "`None`"), gen.ParamRow("k", "float", "`0.01`")]
    assert gen.parameter_table(rows).splitlines() == [
        "| key | type | default |", "|---|---|---|", "| `z` | float or None | `None` |", "| `k` | float | `0.01` |"]
    declared = [gen.ParamRow("k", "float", "`0.01`", "a number in (0, 1]", "share of coordinates sent")]
    assert gen.parameter_table(declared).splitlines()[0::2] == [
        "| key | type | default | allowed | meaning |", "| `k` | float | `0.01` | a number in (0, 1] | share of coordinates sent |"]
    assert gen.parameter_table([]) == "Parameters: none.\n"
    assert gen.docstring_markdown("Title.\n\nEvery label is::\n\n    y -> C - 1 - y\nsee :func:`x`\n- a\n") == (
        "Title.\n\nEvery label is:\n\n    y -> C - 1 - y\nsee ``x``\n\n- a\n")


def test_the_docs_build_strictly_and_reference_nothing_online(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        message = "mkdocs is not installed: `pip install -e '.[docs]'` builds the manual"
        if os.environ.get("ROBUST_DOCS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr.replace("MKDOCS_2_WARNING", "")
    html = {p: p.read_text() for p in site.rglob("*.html")}
    for name in ("aggregators", "pre-aggregators", "attacks", "codecs", "detectors", "python"):
        assert (site / "reference" / name / "index.html") in html
    assert "Blanchard et al." in html[site / "reference" / "aggregators" / "index.html"]
    assert "RobustStrategy" in html[site / "reference" / "python" / "index.html"]
    assert (site / "assets" / "dashboard.png").stat().st_size > 0
    online = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    fetched = {str(p.relative_to(site)): online.findall(t) for p, t in html.items() if online.search(t)}
    assert not fetched, f"pages that load something from the network: {fetched}"
