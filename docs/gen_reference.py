"""Write the component reference (``reference/*.md``) from the code, at every docs build.

Run by mkdocs-gen-files (``mkdocs.yml``: ``plugins: gen-files``); ``python docs/gen_reference.py
DIR`` writes the same pages into ``DIR`` (what ``tests/test_docs.py`` reads). Nothing here is
written by hand about a component: the names come from the registries (``aggregators``,
``attacks``, ``robust.codecs``) and ``nodes.engine.detectors.DETECTORS``; the text is each
component's own docstring (the file named after it: its paper and its formula); the parameter
table comes from :func:`declared_parameters`, the one function that reads a component's
parameters.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `mkdocs build` from a clone that was not `pip install -e`-ed
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class ParamRow:
    """One row of a component's parameter table."""

    key: str
    type: str
    default: str
    allowed: str = ""  # the declared range; empty until the components declare their parameters
    meaning: str = ""  # the declared one-line meaning; likewise


def declared_parameters(cls: type) -> list[ParamRow]:
    """The parameters a spec may give ``cls`` (key, type, default, allowed, meaning): its
    declarations (``robust.registry.Component.declared``, each a ``robust.constraints.Param``),
    the one place the reference learns what a component takes, as the code checks it."""
    return [ParamRow(key, p.kind.__name__ + (" or None" if p.default is None else ""), f"`{p.default!r}`",
                     p.rule.describe(), p.help + (" (a hyperparameter `robust bench --tune` chooses)" if p.tune else ""))
            for key, p in cls.declared().items()]


def parameter_table(rows: list[ParamRow]) -> str:
    """The Markdown table of a component's parameters (or a line saying it takes none): key,
    type and default, then the allowed values and the meaning where they are declared."""
    if not rows:
        return "Parameters: none.\n"
    columns = [c for c in ("type", "default", "allowed", "meaning") if c == "default" or any(getattr(r, c) for r in rows)]
    lines = ["| key | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for r in rows:
        cells = [f"`{r.key}`"] + [getattr(r, c).replace("|", "\\|") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def setting_rows(table: dict) -> list[ParamRow]:
    """The rows of a table of declared settings (``robust.constraints.Param``): what a
    component's rows become once its parameters are declared the same way."""
    return [ParamRow(p.key, "", f"`{json.dumps(p.default)}`", p.rule.describe(), p.help) for p in table.values()]


def docstring_markdown(doc: str | None) -> str:
    """A docstring (reST-flavoured plain text) as Markdown: roles dropped, literal blocks fenced
    by indentation, a blank line before a list so Markdown sees it."""
    text = inspect.cleandoc(doc or "")
    text = re.sub(r":(?:func|class|meth|data|attr|mod|obj):`~?([^`]+)`", r"``\1``", text)
    out: list[str] = []
    for line in text.splitlines():
        if line.endswith("::"):  # reST's literal block: in Markdown, the indentation alone
            line = line[:-1]
        if line.startswith("- ") and out and out[-1].strip() and not out[-1].startswith(("- ", "  ")):
            out.append("")
        out.append(line)
    return "\n".join(out).strip() + "\n"


def _source(cls: type) -> str:
    return Path(inspect.getfile(cls)).resolve().relative_to(ROOT).as_posix()


def component_section(name: str, cls: type, facts: Iterable[str]) -> str:
    """One component: its name, facts, its module's docstring, its parameter table."""
    module = inspect.getmodule(cls)
    parts = [f"## `{name}`\n", " · ".join([*facts, f"`{_source(cls)}`"]) + "\n"]
    parts.append(docstring_markdown(module.__doc__ if module else cls.__doc__))
    parts.append(parameter_table(declared_parameters(cls)))
    return "\n".join(parts)


def family_page(title: str, intro: str, entries: dict[str, type], facts: Callable[[type], list[str]]) -> str:
    overview = ["| name | parameters | summary |", "|---|---|---|"]
    for name, cls in entries.items():
        params = ", ".join(f"`{r.key}`" for r in declared_parameters(cls)) or "none"
        module = inspect.getmodule(cls)
        first = inspect.cleandoc((module.__doc__ if module else cls.__doc__) or "").split("\n\n")[0]
        summary = docstring_markdown(first).strip().replace("\n", " ").replace("|", "\\|")
        overview.append(f"| [`{name}`](#{_anchor(name)}) | {params} | {summary} |")
    body = [f"# {title}\n", intro.strip() + "\n", "\n".join(overview) + "\n"]
    body += [component_section(name, cls, facts(cls)) for name, cls in entries.items()]
    return "\n".join(body)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", name.lower())


GENERATED = "*Generated at every build from the code (`docs/gen_reference.py`): the registry's names, each file's docstring, the parameters the class takes.*"


def pages() -> dict[str, str]:
    """Every generated page, by path under ``docs/``."""
    import aggregators
    import attacks
    from aggregators.base import REGISTRY as STAGES
    from attacks.base import REGISTRY as ATTACKS
    from nodes.engine import detectors
    from robust import codecs
    from robust.codecs.base import REGISTRY as CODECS

    def stage_facts(cls: type) -> list[str]:
        needs = sorted(cls.needs)
        return ["rule" if cls.is_rule else "pre-aggregator"] + ([f"needs {', '.join(needs)}"] if needs else [])

    out = {}
    rules = {n: STAGES.entries[n] for n in aggregators.rules()}
    pre = {n: STAGES.entries[n] for n in aggregators.pre_aggregators()}
    out["reference/aggregators.md"] = family_page(
        "Aggregation rules",
        f"""{GENERATED}

A spec ends with one rule, after any [pre-aggregators](pre-aggregators.md):
`aggregators.build("nnm+trimmed-mean", f=2)`, `--aggregator SPEC`, scenario key `aggregators`.
`f` is the number of Byzantine rows the rule tolerates (`--tolerate`). {len(rules)} rules.""",
        rules, stage_facts,
    )
    out["reference/pre-aggregators.md"] = family_page(
        "Pre-aggregators",
        f"""{GENERATED}

Stages chained before a [rule](aggregators.md) with `+` (`bucketing:s=2+krum`). Each is lazy:
the next stage reads its rows block by block. {len(pre)} pre-aggregators.""",
        pre, stage_facts,
    )
    attack_entries = {n: ATTACKS.entries[n] for n in attacks.names()}
    out["reference/attacks.md"] = family_page(
        "Attacks",
        f"""{GENERATED}

`attacks.build(spec, f)`, `--attack SPEC` (bench, `robust demo`, `robust node join` for the
node-side ones), scenario key `attacks`. *Omniscient* attacks see the round's honest rows and
craft the Byzantine ones (bench only); *node* attacks run on the Byzantine node's own side, as a
volunteer can. Any omniscient attack also takes `spread` (seeded jitter of that many honest
standard deviations per row). `robust attacks` lists them with their files. {len(attack_entries)} attacks.""",
        attack_entries, lambda cls: [cls.kind],
    )
    codec_entries = {n: CODECS.entries[n] for n in codecs.names()}

    def codec_facts(cls: type) -> list[str]:
        return ["biased (encode with error feedback)" if cls.biased else "unbiased"] + (["keyed"] if cls.keyed else [])

    out["reference/codecs.md"] = family_page(
        "Codecs",
        f"""{GENERATED}

How an update travels: `compression = SPEC` (a coordinator setting and a scenario key),
`robust.codecs.build(spec)`. {len(codec_entries)} codecs.""",
        codec_entries, codec_facts,
    )
    out["reference/detectors.md"] = detectors_page(detectors)
    out["reference/settings.md"] = settings_page()
    return out


def settings_page() -> str:
    from nodes.settings import DEPLOY, RUN

    return f"""# Settings

*Generated at every build from their declarations (`nodes/settings.py`: key, rule, default, meaning).*

A run's settings: each is a coordinator setting (`DIR/coordinator.toml`, written by `robust
coordinator init`), an option of `robust coordinator init` and `start` (`--max-norm` for
`max-norm`), and a scenario key of `robust bench` (a list makes a grid axis), checked by the
same rule and refused in one line (`settings: rounds must be an integer >= 1 (got rounds=0)`, exit 2).

## A run's settings

{parameter_table(setting_rows(RUN))}
## Deployment only

The coordinator's own settings (not scenario keys):

{parameter_table(setting_rows(DEPLOY))}"""


def detectors_page(module) -> str:
    """The detectors have no classes: their names are ``DETECTORS`` and each one's text is its
    bullet of the module's docstring; the rest of the docstring is the shared introduction."""
    doc = docstring_markdown(module.__doc__)
    blocks = re.split(r"\n(?=- )", doc)
    intro = blocks[0]
    bullets = {}
    shared = []
    for b in blocks[1:]:
        m = re.match(r"- ``([a-z-]+)``: ", b)
        if m and m.group(1) in module.DETECTORS:
            bullets[m.group(1)] = b[m.end():].strip()
        else:
            shared.append(b.strip())
    missing = [d for d in module.DETECTORS if d not in bullets]
    if missing:
        raise RuntimeError(f"nodes/engine/detectors.py's docstring describes no detector {missing}")
    parts = [
        "# Detectors\n",
        GENERATED.replace("each file's docstring, the parameters the class takes",
                          "the detectors' names (`DETECTORS`) and their module's docstring") + "\n",
        "Every round, the round engine scores every row with each detector (higher: more suspicious). "
        "The bench reports each detector's AUC against the true Byzantine rows; the flag policy "
        "thresholds `distance-ratio` (see [How it works](../concepts.md)). Detectors take no "
        "parameters: `f` is the run's.\n",
        intro,
        "\n\n".join(shared) + "\n",
    ]
    for name in module.DETECTORS:
        parts.append(f"## `{name}`\n\n{bullets[name]}\n")
    return "\n".join(parts)


def main() -> None:
    if len(sys.argv) == 2:  # python docs/gen_reference.py DIR
        for path, text in pages().items():
            target = Path(sys.argv[1]) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return
    import mkdocs_gen_files

    for path, text in pages().items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text)
        mkdocs_gen_files.set_edit_path(path, "docs/gen_reference.py")
    # the dashboard's figure, kept in evaluation/ (tests/test_dashboard.py saves a new one with
    # ROBUST_DASHBOARD_SCREENSHOT=PATH): served from there, never a second copy to go stale
    figures = sorted(ROOT.glob("evaluation/**/dashboard.png"))
    if not figures:
        raise SystemExit("no evaluation/**/dashboard.png, the figure docs/dashboard.md shows (ROBUST_DASHBOARD_SCREENSHOT=PATH pytest tests/test_dashboard.py saves one)")
    with mkdocs_gen_files.open("assets/dashboard.png", "wb") as f:
        f.write(figures[0].read_bytes())


if __name__ in ("__main__", "<run_path>"):
    main()
