"""What the dashboard shows, as JSON: a run folder read, never written.

:class:`RunView` reads a coordinator folder (a demo's root is found as ``robust coordinator
status`` finds it) the way the status does: ``coordinator.toml``, the admission list, the round
log (complete lines only: the coordinator may be writing the last), ``result.json`` and
``failed.txt``. It builds three documents, the dashboard's API:

- ``/api/status``: the run's settings (rule, protocol, round mode, codec, quorum), its state
  and progress, accuracy, node counts, and the audit: the hash chain of the round log
  (intact through round N, or the first round whose line changed; ``robust audit verify``
  also checks signatures and recomputes every round), the spot checks drawn, cleared and
  convicted, and the disputes opened, cleared and convicted; and the events noted beside the
  run (``DIR/events.jsonl``, ``nodes.coordinator.events``: the field lab's faults), the last 100.
- ``/api/rounds``: one entry per round: accuracy, seconds, bytes up and down, replies by kind,
  the nodes flagged, the evidence threshold.
- ``/api/nodes``: one entry per node that is admitted or appears in the log: whether it replied
  last round, its tasks (asked, accepted, rejected with the reasons, failed, declined,
  missing, late), each round it was flagged and why (rejected, or its distance to the median
  against the flag policy's threshold), its evidence (CUSUM) per round against the
  threshold, its quarantine (round and cause) or conviction (round, verifier, distance, and
  the ruling of a dispute that convicted it),
  mean reply seconds, mean staleness, bytes sent.

Documents are rebuilt only when the folder's files change (their sizes and times), so a page
polling every few seconds costs one ``stat`` per file between rounds. Every string is data:
the page renders it as text.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from .. import checkpoint
from ..checkpoint import RUN_ID
from ..coordinator import events, status
from ..coordinator.admission import ADMITTED, scan, short
from ..coordinator.roundlog import chain
from ..engine.names import TO_MEDIAN
from ..settings import SETTINGS_FILE, Settings, coordinator_folder

REASONS = 5  # latest rejection or failure reasons kept per node
LIVE_EVERY = 2.0  # seconds between two looks at whether the run's SuperLink answers
SETTINGS = ("dataset", "model", "seed", "aggregator", "tolerate", "protocol", "round", "late", "buffer", "staleness",
            "compression", "downlink", "deadline", "spot_check", "flag_ratio", "flag_own", "quarantine_after",
            "false_alarm", "loss_evidence", "keep_updates")


class RunView:
    def __init__(self, folder: str | Path) -> None:
        self.folder = coordinator_folder(Path(folder))
        self._key: tuple | None = None
        self._docs: dict = {}
        self._settings: Settings | None = None
        self._live: tuple[float, tuple[str, dict]] = (-LIVE_EVERY, ("", {}))  # (when it was looked at, the state)

    def _stamp(self) -> tuple:
        files = [self.folder / name for name in (checkpoint.ROUNDS, checkpoint.RESULT, checkpoint.FAILED,
                                                 SETTINGS_FILE, ADMITTED, events.EVENTS)]
        return tuple((p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None for p in files)

    def docs(self) -> dict:
        """``{"status": ..., "rounds": ..., "nodes": ...}``, rebuilt when the folder changed."""
        key = self._stamp()
        if key != self._key:
            self._docs, self._key = self._build(), key
        now = time.monotonic()
        if now - self._live[0] >= LIVE_EVERY:  # the SuperLink may stop between rounds: asked at most every 2 s
            self._live = now, status.run_state(self.folder, self._settings)
        state, outcome = self._live[1]
        return {**self._docs, "status": self._docs["status"] | {"state": state} | outcome}

    def _build(self) -> dict:
        settings = self._settings = Settings.read(self.folder)
        run_id = (self.folder / RUN_ID).read_text().strip() if (self.folder / RUN_ID).exists() else ""
        records, broken, _ = chain(run_id, checkpoint.logged_lines(self.folder))
        nodes = _nodes(records, scan(self.folder)[0], settings)
        return {"status": _status(self.folder, settings, records, broken, nodes), "rounds": _rounds(records),
                "nodes": nodes}


def _status(folder: Path, settings: Settings, records: list[dict], broken: list, nodes: list[dict]) -> dict:
    spots = [entry for r in records for entry in r.get("spot", [])]
    disputes = [d for entry in spots for d in entry.get("disputes", [])]
    last = records[-1] if records else {}
    return {
        "folder": str(folder), "round": len(records), "rounds": settings.rounds,
        "settings": {name.replace("_", "-"): getattr(settings, name) for name in SETTINGS}
        | {"quorum": settings.quorum_needed},
        "last_round_seconds": last.get("seconds"),
        "mean_round_seconds": _mean([r["seconds"] for r in records]) if all("seconds" in r for r in records) else None,
        "accuracy": last.get("accuracy"),
        "best_accuracy": max((r["accuracy"] for r in records if r.get("accuracy") is not None), default=None),
        "skipped": sum(1 for r in records if r.get("skipped")),
        "counts": {"admitted": sum(n["admitted"] for n in nodes), "online": sum(n["online"] for n in nodes),
                   "flagged": sum(1 for n in nodes if n["flags"]),
                   "quarantined": sum(1 for n in nodes if n["quarantined"] is not None),
                   "convicted": sum(1 for n in nodes if n["convicted"] is not None)},
        "audit": {
            "chain": "broken" if broken else "intact", "through": broken[0][0] - 1 if broken else len(records),
            "problem": broken[0][1] if broken else "",
            "spot": {"drawn": len(spots), "convicted": sum(1 for s in spots if s.get("guilty")),
                     "cleared": sum(1 for s in spots if not s.get("guilty") and s.get("distance") is not None)},
            "disputes": {"opened": len(disputes), "cleared": sum(1 for d in disputes if not d.get("guilty")),
                         "convicted": sum(1 for d in disputes if d.get("guilty"))},
        },
        "events": [{**e, "node": short(e["node"])} for e in events.read(folder)],
    }


def _rounds(records: list[dict]) -> list[dict]:
    return [{
        "round": r["round"], "accuracy": r.get("accuracy"), "seconds": r.get("seconds"),
        "bytes_up": r.get("bytes_up"), "bytes_down": r.get("bytes_down"), "asked": r.get("asked"),
        "accepted": r.get("accepted"), "rejected": len(r.get("rejected", {})), "failed": len(r.get("failed", {})),
        "missing": len(r.get("missing", [])), "flagged": [short(fp) for fp in r.get("flagged", [])],
        "skipped": r.get("skipped", ""), "evidence_h": r.get("evidence", {}).get("h"),
        "costs": r.get("costs", {}), "train_seconds_max": r.get("train_seconds_max"),
    } for r in records]


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def _flag_reason(record: dict, fp: str, ratio: float) -> str:
    """Why ``fp`` was flagged in ``record``'s round, in words."""
    if fp in record.get("rejected", {}):
        return f"rejected: {record['rejected'][fp]}"
    distances, typical = record.get("scores", {}).get(TO_MEDIAN), record.get("typical")
    if distances and typical and fp in record["ids"]:
        own = record.get("own", {}).get(fp)  # its own typical distance, where higher than the run's
        whose, bar = ("its own", own) if own else ("the run's", typical)
        return (f"{distances[record['ids'].index(fp)] / bar:.1f}x {whose} typical distance to the median "
                f"(flagged above {ratio:g}x)")
    return "its distance to the median"


def _quarantine_reason(record: dict, fp: str, cause: str, settings: Settings) -> str:
    """Why ``fp`` was quarantined in ``record``'s round, in words (evidence crosses its threshold
    in a round that scored the node: that round's record holds both)."""
    if cause == "flags":
        return f"flagged in {settings.quarantine_after} rounds (quarantine-after)"
    if cause in ("evidence", "loss score"):
        key, what = ("evidence", "its evidence") if cause == "evidence" else ("loss_evidence", "its loss-score evidence")
        evidence = record.get(key, {})
        if fp not in evidence.get("S", {}):
            return f"{what} crossed the threshold"
        shared = ", shared by both kinds of evidence" if settings.loss_evidence else ""
        return (f"{what} {evidence['S'][fp]:.1f} crossed the threshold {evidence['h']:.1f} (false-alarm "
                f"{settings.false_alarm:g} over the run{shared})")
    if cause == "convicted" and record.get("rejected", {}).get(fp, "").startswith("convicted in a dispute"):
        return "convicted in a dispute"
    return "convicted by a spot check" if cause == "convicted" else cause


def _nodes(records: list[dict], admitted: dict, settings: Settings) -> list[dict]:
    """Every node's row, in one pass over the log (each record's own entries only)."""
    rows: dict[str, dict] = {}

    def node(fp: str) -> dict:
        return rows.setdefault(fp, {"counts": Counter(), "reasons": [], "flags": [], "evidence": [], "replies": [],
                                    "staleness": [], "sent": 0, "quarantined": None, "why": None, "convicted": None})

    for fp in admitted:
        node(fp)
    short_ids = {short(fp): fp for fp in admitted}
    for r in records:
        short_ids.update((short(fp), fp) for fp in r["ids"])
        t, staleness = r["round"], r.get("staleness", {})
        for fp in r["ids"]:
            row = node(fp)
            row["counts"]["accepted"] += 1
            if fp in staleness:
                row["staleness"].append(staleness[fp])
                row["counts"]["late"] += staleness[fp] > 0 and settings.round != "async"
        for kind, entries in (("rejected", r.get("rejected", {})), ("failed", r.get("failed", {}))):
            for fp, reason in entries.items():
                kind_here = "declined" if reason.startswith("declined") else kind
                node(fp)["counts"][kind_here] += 1
                node(fp)["reasons"].append({"round": t, "kind": kind_here, "reason": reason})
        for fp in r.get("missing", []):
            node(fp)["counts"]["missing"] += 1
        for fp in r.get("flagged", []):
            node(fp)["flags"].append({"round": t, "reason": _flag_reason(r, fp, settings.flag_ratio)})
        evidence = r.get("evidence", {})
        for fp, S in evidence.get("S", {}).items():
            node(fp)["evidence"].append([t, S, evidence["h"]])
        for name, seconds in r.get("reply_seconds", {}).items():
            if name in short_ids:
                node(short_ids[name])["replies"].append(seconds)
        for name, (up, _) in r.get("bytes_per_node", {}).items():
            if name in short_ids:
                node(short_ids[name])["sent"] += up
        for fp, cause in r.get("why", {}).items():
            if node(fp)["quarantined"] is None:
                rows[fp]["quarantined"], rows[fp]["why"] = t, _quarantine_reason(r, fp, cause, settings)
        for fp in r.get("convicted", []):
            if node(fp)["convicted"] is None:
                spot = next((s for s in r.get("spot", []) if fp in s.get("guilty", [])), {})
                ruling = next((d for d in spot.get("disputes", []) if d.get("node") == fp), None)
                rows[fp]["convicted"] = {"round": t, "verifier": short(spot.get("verifier") or ""),
                                         "distance": spot.get("distance"),
                                         "as": "author" if spot.get("author") == fp else "verifier",
                                         "dispute": None if ruling is None else str(ruling.get("reason", ""))}
    last = records[-1] if records else {}
    replied_last = {*last.get("ids", []), *last.get("rejected", {}), *last.get("failed", {})}
    out = []
    for fp, row in sorted(rows.items()):
        counts = row["counts"]
        asked = sum(counts[k] for k in ("accepted", "rejected", "failed", "declined", "missing")) - counts["late"]
        out.append({
            "id": short(fp), "fingerprint": fp, "admitted": fp in admitted, "online": fp in replied_last,
            "asked": asked, **{k: counts[k] for k in ("accepted", "rejected", "failed", "declined", "missing", "late")},
            "reasons": row["reasons"][-REASONS:], "flags": len(row["flags"]), "flag_rounds": row["flags"],
            "evidence": row["evidence"], "quarantined": row["quarantined"], "why": row["why"],
            "convicted": row["convicted"], "reply_seconds": _mean(row["replies"]), "staleness": _mean(row["staleness"]),
            "bytes_up": row["sent"],
        })
    return out


def dumps(doc: object) -> bytes:
    """``doc`` as JSON bytes (no NaN: a record's non-finite accuracy is ``null``)."""
    return json.dumps(checkpoint.finite(doc), allow_nan=False).encode()
