"""Flower's built-in robust aggregators, called the way Flower calls them, on our inputs.

Two generations ship in flwr: the message-API strategies (``flwr.serverapp.strategy``, run
through ``aggregate_train`` on real reply ``Message`` objects) and the legacy functions of
``flwr.server.strategy.aggregate``. Each baseline is split into ``prepare`` (untimed: build
the replies) and ``run`` (timed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from .baseline import Baseline


def _replies(rows: np.ndarray) -> list:
    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    out = []
    for i, row in enumerate(rows):
        meta = Metadata(
            run_id=1, message_id=str(i), src_node_id=i + 1, dst_node_id=0,
            reply_to_message_id="0", group_id="1", created_at=time.time(), ttl=3600.0,
            message_type="train",
        )
        content = RecordDict(
            {"arrays": ArrayRecord([row]), "metrics": MetricRecord({"num-examples": 1})}
        )
        out.append(Message(content, metadata=meta))
    return out


def _message_api(name: str, make_strategy: Callable[[], object], rows: np.ndarray) -> Baseline:
    strategy = make_strategy()
    return Baseline(
        f"flwr {name} (message API)",
        lambda: _replies(rows),
        lambda replies: strategy.aggregate_train(1, replies),  # type: ignore[attr-defined]
    )


def _legacy(name: str, fn: Callable[[list], object], rows: np.ndarray) -> Baseline:
    return Baseline(f"flwr {name} (legacy)", lambda: [([r], 1) for r in rows], fn)


def baselines(rule: str, X: torch.Tensor, f: int) -> list[Baseline]:
    """Flower's equivalents of our ``rule`` (none for rules Flower does not ship)."""
    from flwr.server.strategy import aggregate as legacy
    from flwr.serverapp import strategy as msg

    logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = X.numpy()
    n = rows.shape[0]
    table: dict[str, list[Baseline]] = {
        "mean": [
            _message_api("FedAvg", msg.FedAvg, rows),
            _legacy("aggregate", legacy.aggregate, rows),
        ],
        "krum": [
            _message_api("Krum", lambda: msg.Krum(num_malicious_nodes=f), rows),
            _legacy("aggregate_krum", lambda r: legacy.aggregate_krum(r, f, 0), rows),
        ],
        "multi-krum": [
            _message_api(
                "MultiKrum",
                lambda: msg.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f),
                rows,
            ),
            _legacy("aggregate_krum", lambda r: legacy.aggregate_krum(r, f, n - f), rows),
        ],
        "median": [
            _message_api("FedMedian", msg.FedMedian, rows),
            _legacy("aggregate_median", legacy.aggregate_median, rows),
        ],
        "trimmed-mean": [
            _message_api("FedTrimmedAvg", lambda: msg.FedTrimmedAvg(beta=f / n), rows),
            _legacy(
                "aggregate_trimmed_avg", lambda r: legacy.aggregate_trimmed_avg(r, f / n), rows
            ),
        ],
        "bulyan": [
            _message_api("Bulyan", lambda: msg.Bulyan(num_malicious_nodes=f), rows),
            _legacy(
                "aggregate_bulyan",
                lambda r: legacy.aggregate_bulyan(
                    r, f, legacy.aggregate_krum, to_keep=0
                ),
                rows,
            ),
        ],
    }
    return table.get(rule, [])
