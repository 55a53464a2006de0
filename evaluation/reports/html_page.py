"""The bench report as one self-contained web page: ``summary.html`` beside ``summary.md``.

The page is made from ``summary.md`` itself, so the two always say the same: its headings,
paragraphs, bullet lists and tables become HTML, and each figure it links (``![name](file.png)``,
a file beside it) is embedded as a data URI, so the page can be mailed or archived alone.
The markdown is the report's own small dialect (``evaluation.reports.tables``): headings, ``- `` lists,
``| ... |`` tables, inline ``code`` and ``**bold**``. Every piece of text is escaped before
any markup is added: a scenario value or attack name holding ``<`` shows as that character.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

IMAGE = re.compile(r"^!\[([^\]]*)\]\(([^)]+)\)$")
CODE = re.compile(r"`([^`]+)`")
BOLD = re.compile(r"\*\*([^*]+)\*\*")
STYLE = """
body { margin: 0 auto; max-width: 1200px; padding: 12px 24px 40px; color: #1d2330;
       font: 14px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #d9dde6; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #d9dde6; padding: 3px 8px; text-align: left; }
th { background: #f2f4f8; } tr:nth-child(even) td { background: #fafbfc; }
td:not(:first-child) { font-variant-numeric: tabular-nums; }
code { background: #f2f4f8; padding: 0 3px; border-radius: 3px; }
figure { margin: 12px 0; } figure img { max-width: 100%; border: 1px solid #d9dde6; }
figcaption { color: #6b7385; font-size: 12px; }
"""


def inline(text: str) -> str:
    """``text`` escaped, with its ``code`` and **bold** spans as HTML."""
    return BOLD.sub(r"<strong>\1</strong>", CODE.sub(r"<code>\1</code>", html.escape(text)))


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def _figure(folder: Path, alt: str, name: str) -> str:
    path = folder / name
    if path.suffix.lower() != ".png" or not path.is_file():
        return f"<p>{inline(f'(figure {name} is not beside the report)')}</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(name)}</figcaption></figure>")


def to_html(markdown: str, folder: Path) -> str:
    """The page of the report ``markdown`` whose figures are files in ``folder``."""
    out, paragraph, lines = [], [], markdown.splitlines()

    def close_paragraph() -> None:
        if paragraph:
            out.append(f"<p>{inline(' '.join(paragraph))}</p>")
            paragraph.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        heading, image = re.match(r"^(#{1,6}) (.*)$", line), IMAGE.match(line)
        if not line.strip() or heading or image or line.startswith(("|", "- ")):
            close_paragraph()
        if heading:
            level = len(heading.group(1))
            out.append(f"<h{level}>{inline(heading.group(2))}</h{level}>")
        elif image:
            out.append(_figure(folder, image.group(1), image.group(2)))
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            header, body = _cells(rows[0]), [r for r in rows[1:] if not re.fullmatch(r"\|( --- \|)+", r.strip())]
            out.append("<table><thead><tr>" + "".join(f"<th>{inline(c)}</th>" for c in header) + "</tr></thead><tbody>"
                       + "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in _cells(r)) + "</tr>" for r in body)
                       + "</tbody></table>")
            continue
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{inline(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif line.strip():
            paragraph.append(line.strip())
        i += 1
    close_paragraph()
    title = next((inline(m.group(1)) for m in map(re.compile(r"^# (.*)$").match, lines) if m), "robust bench report")
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def write_html(summary: Path) -> Path:
    """Write ``summary.html`` beside the report ``summary`` (``summary.md``); return its path."""
    path = summary.with_suffix(".html")
    path.write_text(to_html(summary.read_text(encoding="utf-8"), summary.parent), encoding="utf-8")
    return path
