"""The coordinator's state and round logic, with no Flower in sight.

:class:`Coordinator` holds the model, the aggregation chain (and its state), per-node flags
and quarantine. For each round it makes the task, checks every reply (:meth:`check`), then
:meth:`finish_round` runs canonical order -> aggregate -> flag -> apply -> evaluate ->
checkpoint. The Flower ServerApp (``nodes/server_app.py``) only moves messages.
Everything is a function of the settings, the seed and the accepted replies, so the same
replies give the same bits in any arrival order, and a restart resumes exactly.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

import aggregators
from robust import keys
from robust.data import load
from robust.models import accuracy, build_model
from robust.params import flat_params, sha256, unflatten
from robust.seeds import generator

from . import checkpoint
from .admission import admitted
from .protocol import Reply, Task, signed_payload
from .rounds import canonical, rejection_reason
from .settings import Settings
from .suspicion import flagged

log = logging.getLogger("robust.coordinator")
RUN_ID = "run-id"
# Settings a resumed run must share with its checkpoint (rounds, deadline... may change).
FIXED = ("seed", "dataset", "model", "aggregator", "tolerate", "local_epochs", "batch_size", "lr", "momentum")


def short(fp: str) -> str:
    """The node name shown to people: the first 12 hex digits of its fingerprint."""
    return fp[:12]


class Coordinator:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.settings = s = Settings.read(self.folder)
        self.run_id = (self.folder / RUN_ID).read_text().strip()
        self.keys = admitted(self.folder)
        data = load(s.dataset, root=s.data_root or None, seed=0)
        self.x_test, self.y_test = data.x_test, data.y_test
        self.model = build_model(s.model, data.shape, data.classes, s.seed)
        self.w = flat_params(self.model)
        self.chain = aggregators.build(s.aggregator, s.tolerate)
        self.round = 0  # rounds finished
        self.flags: dict[str, int] = {}
        self.rejected: dict[str, str] = {}  # node -> latest reason
        self.ever_flagged: set[str] = set()
        self._resume()

    # -- state ---------------------------------------------------------------------------

    @property
    def w(self) -> torch.Tensor:
        """The global model, flat; :attr:`base` is its SHA-256, kept with it (checking each
        reply against the base must not re-hash the model)."""
        return self._w

    @w.setter
    def w(self, value: torch.Tensor) -> None:
        self._w, self.base = value, sha256(value)

    def _resume(self) -> None:
        state = checkpoint.load(self.folder)
        if state is None:
            return
        saved = state["settings"]
        changed = [k for k in FIXED if saved[k] != getattr(self.settings, k)]
        if changed:
            raise ValueError(
                f"{self.folder} holds a checkpoint made with different {', '.join(changed)} "
                f"({', '.join(f'{k}={saved[k]!r}' for k in changed)}): start with the same values, "
                "or use a new folder for a new run"
            )
        self.w, self.round = state["w"], int(state["round"])
        self.chain.load_state(state["chain"])
        self.flags, self.rejected = dict(state["flags"]), dict(state["rejected"])
        self.ever_flagged = set(state["ever_flagged"])
        log.info("resumed from %s after round %d", self.folder / checkpoint.CHECKPOINT, self.round)

    def save(self) -> None:
        checkpoint.save(self.folder, {
            "settings": {k: getattr(self.settings, k) for k in FIXED}, "w": self.w, "round": self.round,
            "chain": self.chain.state(), "flags": self.flags, "rejected": self.rejected,
            "ever_flagged": sorted(self.ever_flagged),
        })

    @property
    def done(self) -> bool:
        return self.round >= self.settings.rounds

    @property
    def quarantined(self) -> set[str]:
        return {fp for fp, k in self.flags.items() if k >= self.settings.quarantine_after}

    # -- a round ---------------------------------------------------------------------------

    def select(self, online: list[str]) -> list[str]:
        """The nodes asked this round: admitted, online, not quarantined; a seeded sample of
        ``per_round`` of them (every one if 0), in canonical order. The admission list is
        re-read, so a key admitted while the run goes on is used from the next round."""
        self.keys = admitted(self.folder)
        pool = sorted(fp for fp in set(online) if fp in self.keys and fp not in self.quarantined)
        k = self.settings.per_round or len(pool)
        if k >= len(pool):
            return pool
        order = torch.randperm(len(pool), generator=generator(self.settings.seed, self.round + 1, "select"))
        return sorted(pool[i] for i in order[:k].tolist())

    def task(self) -> tuple[Task, np.ndarray]:
        s = self.settings
        task = Task(run=self.run_id, round=self.round + 1, base=self.base, seed=s.seed, dataset=s.dataset,
                    model=s.model, local_epochs=s.local_epochs, batch_size=s.batch_size, lr=s.lr, momentum=s.momentum)
        return task, self.w.numpy()

    def check(self, fp: str, reply: Reply, row: np.ndarray | None) -> torch.Tensor | str:
        """The reply's update as a row, or the reason it is rejected."""
        if reply.refused:
            return f"refused the task: {reply.refused}"
        if reply.run != self.run_id:
            return f"signed for run {reply.run!r}, this is run {self.run_id!r}"
        if reply.round != self.round + 1:
            return f"signed for round {reply.round}, this is round {self.round + 1} (a replay?)"
        if reply.base != self.base:
            return f"trained on base model {reply.base[:12]}, not the current {self.base[:12]} (stale)"
        tensor = torch.from_numpy(np.array(row, copy=True)) if row is not None else None
        reason = rejection_reason(tensor, self.w.numel(), self.settings.max_norm)
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
        """Aggregate the accepted rows, flag, apply, evaluate, checkpoint; the round's record.

        ``rejected`` replies (bad content) count as flags; ``failed`` ones (a transport error,
        or a node declining the task) are recorded without a flag: they are not lies.
        ``train_seconds`` (what nodes say their training took) only feeds the overhead figure."""
        s, t, failed = self.settings, self.round + 1, failed or {}
        for fp, reason in rejected.items():
            self.rejected[fp] = reason
            self.flags[fp] = self.flags.get(fp, 0) + 1
            log.warning("round %d: rejected %s: %s", t, short(fp), reason)
        for fp, reason in failed.items():
            log.warning("round %d: no usable reply from %s: %s", t, short(fp), reason)
        missing = sorted(set(asked) - set(rows) - set(rejected) - set(failed))
        record = {"round": t, "asked": len(asked), "accepted": len(rows),
                  "rejected": {short(fp): r for fp, r in sorted(rejected.items())},
                  "failed": {short(fp): r for fp, r in sorted(failed.items())},
                  "missing": [short(fp) for fp in missing], "flagged": [], "skipped": ""}
        if len(rows) < s.quorum:
            record["skipped"] = f"{len(rows)} valid replies, quorum is {s.quorum}: no step"
        else:
            ids, X = canonical(rows)
            aggregate = self.chain(X)
            for fp, bad in zip(ids, flagged(X, self.chain.last_kept, s.flag_ratio).tolist()):
                if bad:
                    self.flags[fp] = self.flags.get(fp, 0) + 1
                    self.ever_flagged.add(fp)
                    record["flagged"].append(short(fp))
            self.w = self.w + aggregate
        self.round = t
        record["quarantined"] = sorted(short(fp) for fp in self.quarantined)
        record["accuracy"] = accuracy(self.model, unflatten(self.w, self.model), self.x_test, self.y_test)
        record["model_sha256"] = self.base
        record["seconds"] = round(time.monotonic() - started, 3)
        record["train_seconds_max"] = round(max(((train_seconds or {}).get(fp, 0.0) for fp in rows), default=0.0), 3)
        self.save()
        checkpoint.append_round(self.folder, record)
        if self.done:
            self.finish(record["accuracy"])
        return record

    def finish(self, final_accuracy: float) -> None:
        """Write the final model (a ``state_dict``) and ``result.json``."""
        params = {k: v.clone() for k, v in unflatten(self.w, self.model).items()}
        checkpoint.write_atomic(self.folder / "model.pt", lambda out: torch.save(params, out))
        checkpoint.write_result(self.folder, {
            "final_accuracy": final_accuracy, "model_sha256": self.base, "rounds": self.round,
            "rejected": {short(fp): r for fp, r in sorted(self.rejected.items())},
            "flagged": sorted(short(fp) for fp in self.ever_flagged),
            "quarantined": sorted(short(fp) for fp in self.quarantined),
        })
