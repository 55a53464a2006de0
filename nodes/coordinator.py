"""The coordinator: the round engine (``nodes.engine``) with a folder, keys and a transport.

:class:`Coordinator` reads its settings, admission list and run id from its folder, makes
each round's task, checks every reply as it arrives (:meth:`check`: run, round, base model,
shape, signature, sample count), then :meth:`finish_round` hands the accepted rows to
:meth:`Engine.step` and checkpoints. The Flower ServerApp (``nodes/server_app.py``) only
moves messages. Everything is a function of the settings, the seed and the accepted
replies, so the same replies give the same bits in any arrival order, and a restart
resumes exactly.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from robust import keys
from robust.data import load
from robust.models import build_model
from robust.params import sha256, unflatten

from . import checkpoint
from .admission import admitted
from .engine import Engine, ThreatHook
from .rows import canonical, rejection_reason
from .settings import Settings
from .wire import Reply, Task, signed_payload

log = logging.getLogger("robust.coordinator")
RUN_ID = "run-id"
# Settings a resumed run must share with its checkpoint (rounds, deadline... may change).
FIXED = ("seed", "dataset", "model", "aggregator", "tolerate", "protocol", "batch_size", "lr", "momentum", "threads")


def short(fp: str) -> str:
    """The node name shown to people: the first 12 hex digits of its fingerprint."""
    return fp[:12]


class Coordinator:
    def __init__(self, folder: str | Path, hook: ThreatHook | None = None) -> None:
        self.folder = Path(folder)
        self.settings = s = Settings.read(self.folder)
        self.run_id = (self.folder / RUN_ID).read_text().strip()
        self.keys = admitted(self.folder)
        data = load(s.dataset, root=s.data_root or None, seed=0)
        self.engine = Engine(s, build_model(s.model, data.shape, data.classes, s.seed), data.x_test, data.y_test, hook)
        self.rejected: dict[str, str] = {}  # node -> its latest rejection's reason
        self._resume()

    @property
    def round(self) -> int:
        return self.engine.round

    @property
    def done(self) -> bool:
        return self.engine.done

    def _resume(self) -> None:
        state = checkpoint.load(self.folder)
        if state is None:
            return
        saved = state["settings"]
        changed = [k for k in FIXED if saved.get(k) != getattr(self.settings, k)]
        if changed:
            raise ValueError(
                f"{self.folder} holds a checkpoint made with different {', '.join(changed)} "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): start with the same values, "
                "or use a new folder for a new run"
            )
        self.engine.load_state(state["engine"])
        self.rejected = dict(state["rejected"])
        log.info("resumed from %s after round %d", self.folder / checkpoint.CHECKPOINT, self.round)

    def save(self) -> None:
        checkpoint.save(self.folder, {"settings": {k: getattr(self.settings, k) for k in FIXED},
                                      "engine": self.engine.state(), "rejected": self.rejected})

    def select(self, online: list[str]) -> list[str]:
        """The nodes asked this round (``Engine.select`` of the admitted online ones). The
        admission list is re-read, so a key admitted while the run goes on is used from the
        next round."""
        self.keys = admitted(self.folder)
        return self.engine.select([fp for fp in online if fp in self.keys])

    def task(self) -> tuple[Task, np.ndarray]:
        return Task.of(self.settings, self.run_id, self.round + 1, self.engine.base), self.engine.w.numpy()

    def receive(self, fp: str, reply: Reply, row: np.ndarray | None, rows: dict[str, torch.Tensor],
                rejected: dict[str, str], failed: dict[str, str]) -> None:
        """File node ``fp``'s decoded reply: its row under ``rows``, a bad reply under
        ``rejected`` (a flag), a declined task under ``failed`` (not a lie: no flag)."""
        if reply.refused:
            failed[fp] = f"declined the task: {reply.refused[:200]}"
            return
        result = self.check(fp, reply, row)
        if isinstance(result, str):
            rejected[fp] = result
        else:
            rows[fp] = result

    def check(self, fp: str, reply: Reply, row: np.ndarray | None) -> torch.Tensor | str:
        """The update of a reply that did not decline, as a row, or why it is rejected."""
        if reply.run != self.run_id:
            return f"signed for run {reply.run!r}, this is run {self.run_id!r}"
        if reply.round != self.round + 1:
            return f"signed for round {reply.round}, this is round {self.round + 1} (a replay?)"
        if reply.base != self.engine.base:
            return f"trained on base model {reply.base[:12]}, not the current {self.engine.base[:12]} (stale)"
        tensor = torch.from_numpy(np.array(row, copy=True)) if row is not None else None
        reason = rejection_reason(tensor, self.engine.w.numel(), self.settings.max_norm)
        if reason:
            return reason
        payload = signed_payload(reply.run, reply.round, reply.base, sha256(tensor), reply.count)
        if fp not in self.keys or not keys.verify(self.keys[fp], reply.signature, payload):
            return "bad signature"
        if not 1 <= reply.count <= self.settings.max_count:
            return f"sample count {reply.count} outside [1, {self.settings.max_count}]"
        return tensor

    def finish_round(self, asked: list[str], rows: dict[str, torch.Tensor], rejected: dict[str, str],
                     started: float, train_seconds: dict[str, float] | None = None,
                     failed: dict[str, str] | None = None) -> dict:
        """The engine's round on the accepted rows, then checkpoint and log; the round's record.

        ``rejected`` replies (bad content) count as flags; ``failed`` ones (a transport error,
        or a node declining the task) are recorded without a flag: they are not lies.
        ``train_seconds`` (what nodes say their training took) only feeds the overhead figure."""
        ids, X = canonical(rows, self.engine.w.numel())
        record = self.engine.step(asked, ids, X, rejected, failed)
        for fp, reason in record["rejected"].items():
            self.rejected[fp] = reason
            log.warning("round %d: rejected %s: %s", record["round"], short(fp), reason)
        for fp, reason in record["failed"].items():
            log.warning("round %d: no usable reply from %s: %s", record["round"], short(fp), reason)
        record["seconds"] = round(time.monotonic() - started, 3)
        record["train_seconds_max"] = round(max(((train_seconds or {}).get(fp, 0.0) for fp in ids), default=0.0), 3)
        self.save()
        checkpoint.append_round(self.folder, record)
        if self.done:
            self.finish(record["accuracy"])
        return record

    def finish(self, final_accuracy: float) -> None:
        """Write the final model (a ``state_dict``) and ``result.json``."""
        engine = self.engine
        params = {k: v.clone() for k, v in unflatten(engine.w, engine.model).items()}
        checkpoint.write_atomic(self.folder / "model.pt", lambda out: torch.save(params, out))
        checkpoint.write_result(self.folder, {
            "final_accuracy": final_accuracy, "model_sha256": engine.base, "rounds": self.round,
            "rejected": {short(fp): r for fp, r in sorted(self.rejected.items())},
            "flagged": sorted(short(fp) for fp in engine.flags.flags),
            "quarantined": sorted(short(fp) for fp in engine.flags.quarantined),
        })
