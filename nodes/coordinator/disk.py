"""What a run will store, said before it is spent.

A round stores its kept updates in ``DIR/updates`` (``keep-updates``: all of them, the
spot-checked ones, none) at the codec's size (``compression``: a float32 row of the model's
``d`` trained parameters, or the arrays an int8 or sign node sends); a spooled round
(``spool``) also holds all its accepted rows there, decoded to float32, until the round ends,
and a rule that carries rows across rounds keeps them in ``DIR/state`` (old and new ones while
a round runs). The projection is the rounds left times what a round keeps, plus one round's
spool and the rule's state; a run whose projection passes the folder's free disk is refused
before any process starts.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings


@dataclass(frozen=True)
class Projection:
    row: int  # bytes of one stored update (values; the files' headers add a few hundred bytes)
    per_round: int  # bytes a round keeps
    spool: int  # bytes a round holds on disk while it runs (0: rows wait in memory)
    total: int  # bytes the rounds left will add
    folder: Path  # the coordinator's folder
    state: int = 0  # bytes the rule's rows carried across rounds take in state/, at most

    @property
    def free(self) -> int:
        """Bytes free in the coordinator's folder, now."""
        return shutil.disk_usage(self.folder).free

    def describe(self, rounds: int) -> str:
        stored = self.total - self.spool - self.state
        what = f"stores {_size(self.per_round)} a round in updates/ ({_size(stored)} over {rounds} rounds)"
        spool = f", spools up to {_size(self.spool)} a round" if self.spool else ""
        state = f", keeps up to {_size(self.state)} of rule state in state/" if self.state else ""
        return f"{what}{spool}{state}; {_size(self.free)} free"


def project(folder: Path, settings: Settings, d: int, nodes: int, rounds_left: int, spooling: bool,
            state_rows: int = 0) -> Projection:
    """The disk the ``rounds_left`` rounds of ``nodes`` asked nodes will use in ``folder``
    (``state_rows``: the most float32 rows the rule keeps in ``state/`` at once)."""
    from robust import codecs  # here: the coordinator's supervisor checks a Projection without PyTorch

    codec = codecs.build(settings.compression)
    row = codec.nbytes(d)
    asked = min(nodes, settings.per_round) if settings.per_round else nodes
    kept = {"all": asked, "spot": math.ceil(settings.spot_check * asked), "none": 0}[settings.keep_updates]
    # a spooled row is float32 for the rule; a compressed run spools its encoding beside it
    spool = asked * (4 * d + (row if codec.name != "none" else 0)) if spooling else 0
    state = state_rows * 4 * d
    total = rounds_left * kept * row + spool + state
    return Projection(row, kept * row, spool, total, Path(folder), state)


def check(projection: Projection, folder: Path, rounds: int) -> None:
    """Raise ``ValueError`` (what to do) when the projection passes the free disk."""
    if projection.total > projection.free:
        raise ValueError(
            f"this run would store {_size(projection.total)} in {folder} ({_size(projection.per_round)} a round "
            f"x {rounds} rounds) and it has {_size(projection.free)} free: set keep-updates = spot (or none), "
            "train fewer rounds, or move the coordinator folder to a larger disk"
        )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
