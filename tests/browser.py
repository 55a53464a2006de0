"""A real browser for the tests: Debian's headless ``chromium``, and the DOM it rendered.

:func:`render` loads a URL in a fresh headless Chromium (its own profile folder, so no test
sees another's cookies), lets the page's scripts run for ``budget_ms`` of virtual time (the
page's fetches and timers run; network waits do not count), and returns the DOM as the
scripts left it (``--dump-dom``) as a small tree (:class:`Node`); with ``screenshot``, it
also writes a PNG of the page. Without a ``chromium`` on the PATH the calling test is
skipped, unless ``ROBUST_BROWSER=required`` (``.ci/run`` sets it after installing one), where
it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    message = "no chromium on the PATH: `apt-get install chromium` (Debian) runs the browser tests"
    if os.environ.get("ROBUST_BROWSER") == "required":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Node:
    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[Node | str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def all(self, tag: str | None = None, **attrs: str) -> list[Node]:
        """Every element below this one with ``tag`` (any, if ``None``) and these attributes
        (``class_`` for ``class``: one of its classes)."""
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if (tag is None or child.tag == tag) and all(
                        value in child.attrs.get("class", "").split() if name == "class_"
                        else child.attrs.get(name.replace("_", "-")) == value for name, value in attrs.items()):
                    found.append(child)
                found += child.all(tag, **attrs)
        return found

    def one(self, tag: str | None = None, **attrs: str) -> Node:
        found = self.all(tag, **attrs)
        assert len(found) == 1, f"{len(found)} <{tag} {attrs}> in the page"
        return found[0]


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document")
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    return builder.root


def render(url: str, screenshot: Path | None = None, budget_ms: int = 6000, size: str = "1280,1000") -> Node:
    """The DOM of ``url`` after its scripts ran (see the module); ``screenshot``: also a PNG."""
    binary = chromium()
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        common = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                  f"--user-data-dir={profile}", f"--window-size={size}", f"--virtual-time-budget={budget_ms}"]
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert dom.returncode == 0 and dom.stdout, f"chromium failed ({dom.returncode}): {dom.stderr[-2000:]}"
        if screenshot is not None:
            shot = subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, text=True,
                                  timeout=120)
            assert shot.returncode == 0 and screenshot.exists(), f"no screenshot ({shot.returncode}): {shot.stderr[-2000:]}"
    return parse(dom.stdout)
