"""What a report ranks cells by: the final accuracy (higher is better) or, for language models
on a text set (``pystdlib``, ``text``: ``robust.text``), the held-out loss (lower is better).

A record keeps both, per round (``accuracy``, ``loss``) and at the end (``final_accuracy``,
``final_loss``); for text ``accuracy`` is next-byte accuracy, which a model reaches early (35%
by predicting spaces and letters) and then moves little, while the loss keeps falling: the loss
is what says how well a text model trained. So a report whose grid is all text ranks, sets its
damage and its time-to-target by the loss (:data:`LOSS`); any other by accuracy
(:data:`ACCURACY`). Damage is always "how much worse than clean": clean minus attacked
accuracy (percentage points), or attacked minus clean loss (nats per byte).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from robust.data import text_spec

from .tables import pct


@dataclass(frozen=True)
class Metric:
    key: str  # the per-round list in a record
    final: str  # the final value in a record
    name: str  # in sentences
    title: str  # a table's caption
    unit: str  # of a damage
    higher_is_better: bool

    @property
    def scale(self) -> float:
        """What a plot multiplies values by: percent for accuracy."""
        return 100.0 if self.higher_is_better else 1.0

    @property
    def axis(self) -> str:
        """A plot's axis label of a value."""
        return "accuracy (%)" if self.higher_is_better else "held-out loss (nats/byte)"

    def show(self, value: float | None) -> str:
        if value is None or value != value:
            return "—"
        return pct(value) if self.higher_is_better else f"{value:.3f}"

    @property
    def target_is(self) -> str:
        """When a cell reaches its target, in a sentence (``evaluation.reports.target_costs``)."""
        if self.higher_is_better:
            return ("accuracy reaches `target` x the best clean final accuracy of the same aggregator, seed and task "
                    "over every cell, or `target-accuracy`")
        return ("held-out loss falls to the best clean final loss of the same aggregator, seed and task over every "
                "cell divided by `target`, or to `target-loss`")

    @property
    def damage_is(self) -> str:
        """What a damage is, in a sentence."""
        return (f"clean minus attacked {self.name}" if self.higher_is_better
                else f"attacked minus clean {self.name}")

    def show_damage(self, value: float | None) -> str:
        if value is None or value != value:
            return "—"
        return pct(value) if self.higher_is_better else f"{value:.3f}"

    def cost(self, clean: float, attacked: float) -> float:
        """How much worse ``attacked`` is than ``clean`` (positive: worse)."""
        return clean - attacked if self.higher_is_better else attacked - clean

    def worse(self, value: float) -> float:
        """A sort key: larger is worse."""
        return -value if self.higher_is_better else value

    def worst(self, values: Iterable[float]) -> float:
        return min(values) if self.higher_is_better else max(values)

    def reached(self, value: float, bar: float) -> bool:
        """Whether ``value`` is at the ``bar`` or better (NaN never is)."""
        return value >= bar if self.higher_is_better else value <= bar

    def of(self, record: dict) -> Sequence[float]:
        """``record``'s per-round values (``None`` where a driver could not compute one: NaN)."""
        return [float("nan") if v is None else v for v in record[self.key]]


ACCURACY = Metric("accuracy", "final_accuracy", "accuracy", "Final accuracy (%)", "pp", True)
LOSS = Metric("loss", "final_loss", "held-out loss", "Final held-out loss (nats per byte)", "nats", False)


def is_text(record: dict) -> bool:
    """Whether ``record`` trained on a text set (``robust.text``)."""
    try:
        return text_spec(str(record.get("config", {}).get("dataset", ""))) is not None
    except ValueError:
        return False


def metric_of(records: Sequence[dict]) -> Metric:
    """:data:`LOSS` when every record trained on a text set, else :data:`ACCURACY`."""
    return LOSS if records and all(is_text(r) and "loss" in r for r in records) else ACCURACY
