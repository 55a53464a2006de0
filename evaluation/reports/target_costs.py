"""What reaching the target accuracy costs a cell: rounds, simulated seconds, bytes up and down.

A cell reaches its target at the first round whose accuracy is at least its *bar* (a report of
language models, ``evaluation.reports.objective.LOSS``: whose held-out loss is at most its bar, set
by ``target-loss``, an absolute loss in nats per byte, else the best clean final loss divided by
``target``: 5% above it at 0.95):

- ``target-accuracy`` when the scenario gives one (an absolute accuracy, e.g. 0.9): the cell
  then writes the costs into its own record as it ends;
- else ``target`` (0.95) x the best clean final accuracy of the cells that share its *task*:
  the same aggregator, seed, data, model, nodes and training, differing only in how and when
  updates travel (the round mode, codec, protocol, clock, rounds: :data:`HOW`). Every
  protocol, codec and speed of a run is then measured against one bar, and a grid that
  spans data sets gives each its own;
- with ``target-of = "baseline"``, ``target`` x the clean final accuracy of the task's
  :data:`BASELINE` way (``momentum``, float32 both ways) instead: for a task where other ways
  train better than the baseline ever does (mnist1d's MLP: 58% after 16 local steps a round,
  47% with ``momentum``), the best's bar is one the baseline never reaches, and no way can be
  said to take fewer bytes than it to get there.

:func:`complete` (which :class:`evaluation.reports.results.Results` applies to what it reads) fills
these costs in for every record.

The costs (:data:`FIELDS`), ``None`` when the target is never reached (or there is no bar):
``round_to_target`` (counted from 0, as the engine's records), ``time_to_target`` (simulated
seconds), ``bytes_up_to_target`` and ``bytes_down_to_target`` (every reply and every task
sent up to the end of that round, as :class:`evaluation.simtime.arrivals.Traffic` counts them).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence

from .objective import ACCURACY, Metric

CLEAN = "none"
# How a cell's updates travel and when: the keys whose values the report sets side by side.
KEYS = ("protocol", "round", "buffer", "staleness", "lookahead", "late", "compression", "downlink", "speed", "link",
        "churn", "deadline")
HOW = frozenset(KEYS + ("rounds", "step-seconds", "calibration", "target", "target-of", "target-accuracy",
                        "target-loss"))
BASELINE = {"protocol": "momentum", "compression": "none", "downlink": "none"}  # the way the others are compared with
OF = ("best", "baseline")  # what ``target`` multiplies: the best clean accuracy of a task, or its baseline's
FIELDS = ("round_to_target", "time_to_target", "bytes_up_to_target", "bytes_down_to_target")
Task = tuple[str, int, str]  # (aggregator, seed, JSON of the config's keys outside HOW)


def first_reached(values: Sequence[float], bar: float, metric: Metric = ACCURACY) -> int | None:
    """Index of the first value at ``bar`` or better (NaN never is); ``None`` if none."""
    return next((i for i, a in enumerate(values) if metric.reached(a, bar)), None)


def costs(record: dict, bar: float | None, metric: Metric = ACCURACY) -> dict:
    """:data:`FIELDS` of ``record`` (its per-round ``accuracy`` or ``loss``, ``times``, ``bytes`` up
    and ``bytes_down_by_round``) against ``bar``; a list a driver does not keep gives ``None``."""
    at = None if bar is None else first_reached(metric.of(record), bar, metric)
    lists = (record.get("times"), record.get("bytes"), record.get("bytes_down_by_round"))
    if at is not None and any(values is not None and len(values) != len(record["accuracy"]) for values in lists):
        raise ValueError(f"record of {record['attack']!r} has {len(record['accuracy'])} accuracies but "
                         f"{[len(v) for v in lists if v is not None]} times/bytes: one entry per round")
    return dict(zip(FIELDS, (at, *(None if at is None or values is None else values[at] for values in lists))))


def task(record: dict) -> Task:
    """What ``record`` shares with the cells measured against the same bar."""
    config = {k: v for k, v in record["config"].items() if k not in HOW}
    return record["aggregator"], record["seed"], json.dumps(config, sort_keys=True)


def sent_as_baseline(config: dict) -> bool:
    """Whether a cell of ``config`` sends as :data:`BASELINE` (a key it does not give has the
    baseline's default)."""
    return all(config.get(k, v) == v for k, v in BASELINE.items())


def bars(records: Sequence[dict], of: str = "best", metric: Metric = ACCURACY) -> dict[Task, float]:
    """Task -> the best clean final value among ``records`` (NaN and missing left out); ``of =
    "baseline"``: among the records of the :data:`BASELINE` way only."""
    best: dict[Task, float] = {}
    for r in records:
        value = r.get(metric.final)
        if (r["attack"] == CLEAN and value is not None and not math.isnan(value)
                and (of == "best" or sent_as_baseline(r["config"]))):
            key = task(r)
            best[key] = value if key not in best else (max if metric.higher_is_better else min)(best[key], value)
    return best


def bar_of(record: dict, found: dict[str, dict[Task, float]], metric: Metric = ACCURACY) -> float | None:
    """The value ``record`` must reach: its absolute ``target-accuracy`` (``target-loss``), else
    ``target`` x its task's best clean accuracy (the best clean loss / ``target``), or its
    baseline's (``target-of``; ``found``: :func:`bars` for each of :data:`OF`); ``None``
    without such a clean cell."""
    config = record["config"]
    absolute = config.get("target-accuracy" if metric.higher_is_better else "target-loss")
    if absolute:
        return float(absolute)
    clean = found[config.get("target-of", "best")].get(task(record))
    if clean is None:
        return None
    target = config.get("target", 0.95)
    return target * clean if metric.higher_is_better else clean / target


def with_costs(record: dict, bar: float | None, metric: Metric = ACCURACY) -> dict:
    """A copy of ``record`` with ``target_bar`` and its :data:`FIELDS` against ``bar``."""
    return {**record, "target_bar": bar, **costs(record, bar, metric)}


def complete(records: Sequence[dict], metric: Metric = ACCURACY) -> list[dict]:
    """Copies of ``records``, each with ``target_bar`` and :data:`FIELDS` (a record that wrote
    its own, against an absolute bar, keeps them), by ``metric``."""
    found = {of: bars(records, of, metric) for of in OF}
    return [r if "target_bar" in r else with_costs(r, bar_of(r, found, metric), metric) for r in records]


def mean_over_seeds(values: Sequence[float | None]) -> float | None:
    """Mean over seeds; ``None`` (never) if any seed never got there."""
    return None if not values or any(v is None for v in values) else statistics.fmean(values)
