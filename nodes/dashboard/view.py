"""What the dashboard shows, as JSON: a run folder read, never written.

:class:`RunView` reads a coordinator folder (a demo's root is found as ``robust coordinator
status`` finds it) the way the status does: ``coordinator.toml``, the admission list, the round
log (complete lines only: the coordinator may be writing the last), ``result.json`` and
``failed.txt``. It builds three documents, the dashboard's API:

- ``/api/status``: the run's settings (rule, protocol, round mode, codec, quorum), its state
  and progress, accuracy, node counts, and the audit: the hash chain of the round log
  (intact through round N, or the first round whose line changed; ``robust audit verify``
  also checks signatures and recomputes every round) and the spot checks drawn, cleared and
  convicted.
- ``/api/rounds``: one entry per round: accuracy, seconds, bytes up and down, replies by kind,
  the nodes flagged, the evidence threshold.
- ``/api/nodes``: one entry per node that is admitted or appears in the log: whether it replied
  last round, its tasks (asked, accepted, rejected with the reasons, failed, declined,
  missing, late), each round it was flagged and why (rejected, or its distance to the median
  against the flag policy's threshold), its evidence (CUSUM) per round against the
  threshold, its quarantine (round and cause) or conviction (round, verifier, distance),
  mean reply seconds, mean staleness, bytes sent.

Documents are rebuilt only when the folder's files change (their sizes and times), so a page
polling every few seconds costs one ``stat`` per file between rounds. Every string is data:
the page renders it as text.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from .. import checkpoint
from ..coordinator import audit, status
from ..coordinator.admission import scan
from ..coordinator.coordinator import short
from ..engine.detectors import TO_MEDIAN
from ..settings import Settings, coordinator_folder

REASONS = 5  # latest rejection or failure reasons kept per node
SETTINGS = ("dataset", "model", "seed", "aggregator", "tolerate", "protocol", "round", "late", "buffer", "staleness",
            "compression", "downlink", "deadline", "spot_check", "flag_ratio", "quarantine_after", "false_alarm",
            "keep_updates")


def _complete(path: Path) -> bytes:
    """The complete lines of ``path`` (none if it is missing)."""
    data = path.read_bytes() if path.exists() else b""
    return data[: data.rfind(b"\n") + 1]


class RunView:
    def __init__(self, folder: str | Path) -> None:
        self.folder = coordinator_folder(Path(folder))
        self._key: tuple | None = None
        self._docs: dict = {}

    def _stamp(self) -> tuple:
        files = [self.folder / name for name in (checkpoint.ROUNDS, checkpoint.RESULT, checkpoint.FAILED,
                                                 "coordinator.toml", "admitted")]
        return tuple((p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None for p in files)

    def docs(self) -> dict:
        """``{"status": ..., "rounds": ..., "nodes": ...}``, rebuilt when the folder changed."""
        key = self._stamp()
        if key != self._key:
            self._docs, self._key = self._build(), key
        live = dict(self._docs["status"])
        live["state"], outcome = status.run_state(self.folder, Settings.read(self.folder))  # the SuperLink may stop
        return {**self._docs, "status": live | outcome}

    def _build(self) -> dict:
        settings = Settings.read(self.folder)
        run_id = (self.folder / "run-id").read_text().strip() if (self.folder / "run-id").exists() else ""
        records, broken, _ = audit.chain(run_id, _complete(self.folder / checkpoint.ROUNDS))
        nodes = _nodes(records, scan(self.folder)[0], settings)
        return {"status": _status(self.folder, settings, records, broken, nodes), "rounds": _rounds(records),
                "nodes": nodes}


def _status(folder: Path, settings: Settings, records: list[dict], broken: list, nodes: list[dict]) -> dict:
    spots = [entry for r in records for entry in r.get("spot", [])]
    last = records[-1] if records else {}
    return {
        "folder": str(folder), "round": len(records), "rounds": settings.rounds,
        "settings": {name.replace("_", "-"): getattr(settings, name) for name in SETTINGS}
        | {"quorum": settings.quorum_needed},
        "last_round_seconds": last.get("seconds"),
        "mean_round_seconds": round(statistics.fmean(r["seconds"] for r in records), 3)
        if records and all("seconds" in r for r in records) else None,
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
        },
    }


def _rounds(records: list[dict]) -> list[dict]:
    return [{
        "round": r["round"], "accuracy": r.get("accuracy"), "seconds": r.get("seconds"),
        "bytes_up": r.get("bytes_up"), "bytes_down": r.get("bytes_down"), "asked": r.get("asked"),
        "accepted": r.get("accepted"), "rejected": len(r.get("rejected", {})), "failed": len(r.get("failed", {})),
        "missing": len(r.get("missing", [])), "flagged": [short(fp) for fp in r.get("flagged", [])],
        "skipped": r.get("skipped", ""), "evidence_h": r.get("evidence", {}).get("h"),
    } for r in records]


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def _flag_reason(record: dict, fp: str, ratio: float) -> str:
    """Why ``fp`` was flagged in ``record``'s round, in words."""
    if fp in record.get("rejected", {}):
        return f"rejected: {record['rejected'][fp]}"
    distances, typical = record.get("scores", {}).get(TO_MEDIAN), record.get("typical")
    if distances and typical and fp in record["ids"]:
        return (f"{distances[record['ids'].index(fp)] / typical:.1f}x the run's typical distance to the median "
                f"(flagged above {ratio:g}x)")
    return "its distance to the median"


def _quarantine_reason(records: list[dict], fp: str, cause: str, settings: Settings) -> str:
    if cause == "flags":
        return f"flagged in {settings.quarantine_after} rounds (quarantine-after)"
    if cause == "evidence":
        last = next((r["evidence"] for r in reversed(records) if fp in r.get("evidence", {}).get("S", {})), None)
        return ("its evidence crossed the threshold" if last is None else
                f"its evidence {last['S'][fp]:.1f} crossed the threshold {last['h']:.1f} (false-alarm "
                f"{settings.false_alarm:g} over the run)")
    return "convicted by a spot check" if cause == "convicted" else cause


def _nodes(records: list[dict], admitted: dict, settings: Settings) -> list[dict]:
    every = sorted({*admitted, *(fp for r in records for fp in (*r["ids"], *r.get("rejected", {}),
                                                                   *r.get("failed", {}), *r.get("missing", [])))})
    last = records[-1] if records else {}
    replied_last = {*last.get("ids", []), *last.get("rejected", {}), *last.get("failed", {})}
    out = []
    for fp in every:
        name, reasons, flag_rounds, evidence = short(fp), [], [], []
        counts: Counter = Counter()
        replies, staleness, sent = [], [], 0
        quarantined = why = convicted = None
        for r in records:
            t = r["round"]
            if fp in r["ids"]:
                counts["accepted"] += 1
                tau = r.get("staleness", {}).get(fp)
                if tau is not None:
                    staleness.append(tau)
                    counts["late"] += tau > 0 and settings.round != "async"
            if fp in r.get("rejected", {}):
                counts["rejected"] += 1
                reasons.append({"round": t, "kind": "rejected", "reason": r["rejected"][fp]})
            if fp in r.get("failed", {}):
                declined = r["failed"][fp].startswith("declined")
                counts["declined" if declined else "failed"] += 1
                reasons.append({"round": t, "kind": "declined" if declined else "failed", "reason": r["failed"][fp]})
            counts["missing"] += fp in r.get("missing", [])
            if fp in r.get("flagged", []):
                flag_rounds.append({"round": t, "reason": _flag_reason(r, fp, settings.flag_ratio)})
            if fp in r.get("evidence", {}).get("S", {}):
                evidence.append([t, r["evidence"]["S"][fp], r["evidence"]["h"]])
            if name in r.get("reply_seconds", {}):
                replies.append(r["reply_seconds"][name])
            sent += r.get("bytes_per_node", {}).get(name, [0, 0])[0]
            if fp in r.get("why", {}) and quarantined is None:
                quarantined, why = t, _quarantine_reason(records[:t], fp, r["why"][fp], settings)
            if fp in r.get("convicted", []) and convicted is None:
                spot = next((s for s in r.get("spot", []) if fp in s.get("guilty", [])), {})
                convicted = {"round": t, "verifier": short(spot.get("verifier") or ""), "distance": spot.get("distance"),
                             "as": "author" if spot.get("author") == fp else "verifier"}
        asked = counts["accepted"] - counts["late"] + counts["rejected"] + counts["failed"] + counts["declined"] \
            + counts["missing"]
        out.append({
            "id": name, "fingerprint": fp, "admitted": fp in admitted, "online": fp in replied_last,
            "asked": asked, **{k: counts[k] for k in ("accepted", "rejected", "failed", "declined", "missing", "late")},
            "reasons": reasons[-REASONS:], "flags": len(flag_rounds), "flag_rounds": flag_rounds,
            "evidence": evidence, "quarantined": quarantined, "why": why, "convicted": convicted,
            "reply_seconds": _mean(replies), "staleness": _mean(staleness), "bytes_up": sent,
        })
    return out


def dumps(doc: object) -> bytes:
    """``doc`` as JSON bytes (no NaN: a record's non-finite accuracy is ``null``)."""
    return json.dumps(checkpoint.finite(doc), allow_nan=False).encode()
