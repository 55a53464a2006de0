"""What a lab run shows that the simulated clock has no word for, per reply and per round: the
raw material of a calibration (``evaluation.simtime.calibration``).

Read after a synchronous run from the volunteers' work logs (when each task was made, by the
ServerApp's clock, and when its reply was handed to the SuperNode, with the seconds it trained),
the round records, when each record appeared, and the pairs' byte counters. All clocks are this
machine's.
"""

from __future__ import annotations

from nodes.wire import DOWNLINK_BYTES

from evaluation.simtime.arrivals import Volunteers


def observe(replies: dict[str, list[dict]], rounds: list[dict], t0: float, times: list[float], crowd: Volunteers,
            d: int, downlink: str, wire: dict[str, tuple[int, int]]) -> dict:
    """``replies``: node -> its work log's training replies; ``times``: each record's appearance,
    seconds after ``t0`` (the run's submission); ``wire``: node -> bytes (up, down) on its pair.
    Every duration is in seconds; a round whose replies the logs lack is passed over."""
    down = DOWNLINK_BYTES[downlink] * d
    by_round: dict[int, list[tuple[str, dict]]] = {}
    for node, entries in replies.items():
        for e in entries:
            by_round.setdefault(e["round"], []).append((node, e))
    tasks, collect, between = [], [], []
    for i, record in enumerate(rounds):
        counted = [(node, e) for node, e in by_round.get(record["round"], [])
                   if node in record["ids"] or node in record["rejected"]]
        for node, e in counted:
            tasks.append(e["time"] - e["task_made"] - e["seconds"] - crowd.download_seconds(node, down))
        ended = t0 + times[i]
        if counted:
            collect.append(ended - max(e["time"] for _, e in counted))
        following = by_round.get(rounds[i + 1]["round"], []) if i + 1 < len(rounds) else []
        if following:
            between.append(min(e["task_made"] for _, e in following) - ended)
    first = by_round.get(rounds[0]["round"], []) if rounds else []
    answered = sum(len(entries) for entries in replies.values())
    return {"task_seconds": [round(s, 4) for s in tasks], "collect_seconds": [round(s, 4) for s in collect],
            "between_seconds": [round(s, 4) for s in between],
            "first_task_seconds": round(min(e["task_made"] for _, e in first) - t0, 4) if first else None,
            "up_bytes": sum(e["bytes"] for entries in replies.values() for e in entries),
            "wire_up_bytes": sum(up for up, _ in wire.values()),
            "down_bytes": answered * down, "wire_down_bytes": sum(dn for _, dn in wire.values())}
