"""Events noted beside a run (``DIR/events.jsonl``): what happened that the coordinator itself
cannot see, such as a volunteer's link going down in the field lab (``robust field``'s faults).
One JSON line each: ``time`` (Unix seconds), ``node`` (a fingerprint, or empty), ``what``.
:func:`note` appends one; :func:`read` gives the last ones, for the dashboard, reading only
complete lines and passing over any that is not an event (nothing there can break a view of
the run: every field is data, shown as text); a line a killed writer left half-written stays
on its own."""

from __future__ import annotations

import json
import time
from pathlib import Path

EVENTS = "events.jsonl"


def note(folder: Path, what: str, node: str = "", at: float | None = None) -> None:
    """Append the event ``what`` (about ``node``; at ``at``, Unix time, or now) to ``folder``'s events."""
    line = {"time": round(time.time() if at is None else at, 3), "node": node, "what": what}
    with open(Path(folder) / EVENTS, "a+b") as out:
        out.seek(0, 2)
        cut = out.tell() > 0 and (out.seek(-1, 2), out.read(1))[1] != b"\n"  # a writer killed mid-line
        out.write((("\n" if cut else "") + json.dumps(line) + "\n").encode())


def read(folder: Path, last: int = 100) -> list[dict]:
    """The last ``last`` events noted in ``folder``, oldest first."""
    try:
        data = (Path(folder) / EVENTS).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        try:
            event = json.loads(line)
            out.append({"time": float(event["time"]), "node": str(event.get("node", ""))[:64],
                        "what": str(event["what"])[:500]})
        except (ValueError, KeyError, TypeError):
            continue
    return out[-last:]
