"""One serve loop (DESIGN, "What feeds a round"): only ``nodes.engine.serve`` and the ledger's
own module issue, close, withdraw, cancel, expire or read a task of the ledger.

Every ``.py`` file of the product and the bench is parsed (never imported); a call counts as
the ledger's when its receiver is named ``ledger`` (``ledger.close(h)``, ``self.ledger.issue``,
``coord.ledger.cancel``). Tests may drive a ledger by hand: they are not the product.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .test_layout import PACKAGES, ROOT, modules

TASK_CALLS = {"issue", "close", "cancel", "expire", "reads", "withdraw", "refusal"}
ALLOWED = {"nodes.engine.serve", "nodes.engine.ledger"}


def ledger_calls(root: Path) -> list[str]:
    """``module:line method`` of every call of a ledger's task method under the tree's packages."""
    found = []
    for name, (path, _) in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in TASK_CALLS):
                continue
            receiver = node.func.value
            named = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if named == "ledger":
                found.append(f"{name}:{node.lineno} {node.func.attr}")
    return found


def test_only_the_serve_loop_moves_tasks_in_the_ledger():
    calls = ledger_calls(ROOT)
    outside = [c for c in calls if c.partition(":")[0] not in ALLOWED]
    assert not outside, f"tasks moved outside the serve loop: {outside}"
    loop = {c.split()[1] for c in calls if c.startswith("nodes.engine.serve:")}
    assert {"issue", "close", "cancel", "expire", "reads", "withdraw"} <= loop  # the loop really is where


def test_the_check_catches_a_second_loop(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "evaluation" / "driver.py").write_text(
        "def play(run):\n    run.ledger.issue('n', 1, 0, 'b', None)\n    ledger = run.ledger\n    ledger.expire(1.0)\n"
        "    run.other.close()\n")
    assert ledger_calls(tmp_path) == ["evaluation.driver:2 issue", "evaluation.driver:4 expire"]
