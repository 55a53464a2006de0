"""A federation's settings: what ``robust coordinator init`` writes to ``DIR/coordinator.toml``,
what ``start`` options override, and what the ServerApp reads. Validated up front, so a bad
value fails before any process starts, with a message that says what to change."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

SETTINGS_FILE = "coordinator.toml"


@dataclass(frozen=True)
class Settings:
    seed: int = 0                 # run seed: node selection, volunteers' batches, the initial model
    dataset: str = "digits"       # the coordinator's test set; volunteers must hold the same data set
    data_root: str = ""           # folder of local files for mnist / fashion-mnist / cifar10
    model: str = "mlp"
    rounds: int = 5
    aggregator: str = "trimmed-mean"
    tolerate: int = 1             # f: Byzantine replies per round the aggregator must survive
    per_round: int = 0            # nodes asked per round (0 = every online, admitted node)
    quorum: int = 3               # valid replies a round needs; fewer at the deadline -> no step
    deadline: float = 60.0        # seconds a round waits for replies
    wait_nodes: float = 120.0     # seconds to wait for `quorum` nodes to come online
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    max_norm: float = 1000.0      # replies with a larger update norm are rejected
    max_count: int = 1_000_000    # replies claiming more samples are rejected (counts are never weights)
    flag_ratio: float = 3.0       # flagged: distance to the median > flag_ratio x the median distance
    quarantine_after: int = 3     # flags (or rejections) before a node is no longer asked
    bind: str = "127.0.0.1"       # address the SuperLink listens on (0.0.0.0 for other machines)
    port: int = 9190

    def __post_init__(self) -> None:
        _positive(self, "rounds", "quorum", "local_epochs", "batch_size", "max_count", "quarantine_after", "port")
        for name in ("deadline", "wait_nodes", "lr", "max_norm", "flag_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{_key(name)} must be a finite number > 0 (got {value!r})")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1) (got {self.momentum!r})")
        if self.tolerate < 0 or self.per_round < 0:
            raise ValueError("tolerate and per-round must be >= 0")
        if self.per_round and self.per_round < self.quorum:
            raise ValueError(f"per-round={self.per_round} is below quorum={self.quorum}: raise per-round or lower quorum")
        import aggregators
        from robust.data import names
        from robust.models import MODELS

        if self.dataset not in names():
            raise ValueError(f"unknown dataset {self.dataset!r}: choose one of {', '.join(names())}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}: choose one of {', '.join(MODELS)}")
        try:
            aggregators.build(self.aggregator, self.tolerate).check_n(self.quorum)
        except ValueError as err:
            raise ValueError(f"{err} [the quorum is {self.quorum}: raise --quorum, or lower --tolerate]") from None

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` (``None`` values ignored), validated."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_toml(self) -> str:
        lines = ["# robust coordinator settings: edit, or override with `robust coordinator start` options"]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            lines.append(f"{_key(field.name)} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def read(cls, folder: str | Path) -> Settings:
        path = Path(folder) / SETTINGS_FILE
        if not path.exists():
            raise ValueError(f"{path} not found: run `robust coordinator init {folder}` first")
        raw = tomllib.loads(path.read_text())
        known = {_key(f.name): f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{path}: unknown settings {', '.join(unknown)} (known: {', '.join(known)})")
        return cls(**{known[k]: v for k, v in raw.items()})


def _key(name: str) -> str:
    return name.replace("_", "-")


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _positive(s: Settings, *names: str) -> None:
    for name in names:
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{_key(name)} must be an integer >= 1 (got {value!r})")
