"""One compute profile (``robust.profiles``) in a process of its own: a machine of the crowd.

PyTorch reads ``ATEN_CPU_CAPABILITY`` and ``DNNL_MAX_CPU_ISA`` once, when it starts, so each
profile gets a process started with them (``spawn``: a fresh interpreter). The process holds
digits and its nodes' memories and answers requests over a pipe, arrays as numpy (pickled by
value): ``author`` (a node's committed work, ``nodes.engine.committed``), ``answer`` (its
answer to a dispute: the same work again, bit for bit), ``recompute`` (an honest recomputation
of a task, as a referee or verifier does), ``settle`` (a referee's ruling,
``nodes.engine.referee``, bit for bit when it replays at the author's own profile), and under
``momentum`` ``row`` (a node's row from the momentum its task named) and ``settle-step`` (that
row refereed as one step, ``nodes.engine.referee.settle_step``). The process
is started by ``robust.profile_process.start``, as the coordinator's ``referee-profile`` is.
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np

from robust.profile_process import start
from robust.profiles import Profile


class Worker:
    """The parent's handle on a profile's process."""

    def __init__(self, spec: str) -> None:
        self.profile = Profile.parse(spec)
        reason = self.profile.refusal()
        if reason:
            raise ValueError(reason)
        self.proc, self.conn = start(self.profile, serve, (self.profile.spec,))
        self._effective: str | None = None
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._sender, daemon=True)
        self.thread.start()

    @property
    def effective(self) -> str:
        """The level PyTorch runs at in the child (its GPU's name for ``cuda``), once it started."""
        if self._effective is None:
            self._effective = self.get()
        return self._effective

    def send(self, *request) -> None:
        """Queue ``request``: a thread sends it, so a full pipe never blocks the reader (the child
        answers while the parent is still sending)."""
        self.outbox.put(request)

    def _sender(self) -> None:
        while (request := self.outbox.get()) is not None:
            self.conn.send(request)
        self.conn.send(None)

    def get(self):
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        self.outbox.put(None)
        self.thread.join(30)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def round_ends(r: int, out, progress, until: float) -> bool:
    """Report round ``r``'s counts ``out`` to ``progress`` (if any); whether the time is up."""
    if progress:
        progress(r, out)
    return time.perf_counter() > until


class Crowd:
    """``nodes`` honest nodes and one node per cheat (``node-000``..., ``cheat-0``...), each with
    its data part and a home profile, the profiles taken in turn; :meth:`on` is the copy of a
    profile's process that serves a node."""

    def __init__(self, workers: list[list[Worker]], nodes: int, cheats: tuple[str, ...]) -> None:
        self.workers = workers
        self.members = [(f"node-{i:03d}", "") for i in range(nodes)] + [(f"cheat-{k}", s) for k, s in enumerate(cheats)]
        self.index = {node: i for i, (node, _) in enumerate(self.members)}
        self.parts = {node: f"{i + 1}/{len(self.members)}" for node, i in self.index.items()}
        self.home = {node: i % len(workers) for node, i in self.index.items()}

    @property
    def profiles(self) -> list[dict]:
        """Each profile's spec and the level (or GPU) it runs at, for a result."""
        return [{"spec": group[0].profile.spec, "effective": group[0].effective} for group in self.workers]

    def on(self, node: str, profile: int) -> Worker:
        copies = self.workers[profile]
        return copies[(self.index[node] // len(self.workers)) % len(copies)]


def serve(conn, spec: str) -> None:
    import torch

    from nodes.engine.committed import author
    from nodes.engine.referee import Claim, settle, settle_step
    from nodes.engine.training import compute, part_of
    from robust.data import load
    from robust.profiles import effective

    profile = Profile.parse(spec)
    device = torch.device("cuda" if profile.kind == "cuda" else "cpu")
    data = load("digits", seed=0)
    parts: dict[str, object] = {}
    memory: dict[str, object] = {}  # node -> what it kept of its last task (before this round's)
    kept: dict[str, object] = {}

    def part(name):
        if name not in parts:
            parts[name] = part_of(data, name)
        return parts[name]

    def tensor(a):
        return torch.from_numpy(np.asarray(a).copy())

    conn.send(effective() if profile.kind == "cpu" else torch.cuda.get_device_name(device))
    while (request := conn.recv()) is not None:
        kind, fields, w, node, name = request[:5]
        task = SimpleNamespace(**{**fields, "threads": profile.threads})  # a task's fields (nodes.wire.Task needs Flower)
        w, p = tensor(w), part(name)
        try:
            if kind in ("author", "answer"):
                attack = request[5]
                last = memory.get(node) if kind == "answer" else kept.get(node)
                done, row = author(task, w, p.x, p.y, p.classes, node, device, attack, None, last,
                                   answering=kind == "answer")
                if kind == "author":
                    memory[node] = kept.get(node)
                    kept[node] = done.memory(task.round, w, row)
                    conn.send((done.row.numpy(), done.root))
                else:
                    claim = done.claim()
                    conn.send((claim.hashes, {i: s.numpy() for i, s in claim.states.items()}))
            elif kind == "recompute":
                conn.send(compute(task, w, p.x, p.y, p.classes, node, device)[0].numpy())
            elif kind == "row":  # a momentum row from the momentum its task named
                conn.send(compute(task, w, p.x, p.y, p.classes, node, device, "", tensor(request[5]))[0].numpy())
            elif kind == "settle-step":  # a momentum row refereed as one step
                before, row = request[5:7]
                conn.send(settle_step(task, w, tensor(before), tensor(row), p.x, p.y, p.classes, node,
                                      device).record())
            elif kind == "settle":
                row, root, claim, exact = request[5:9]
                claim = None if claim is None else Claim(claim[0], {i: tensor(s) for i, s in claim[1].items()})
                conn.send(settle(task, w, p.x, p.y, p.classes, node, tensor(row), root, claim, device,
                                 exact=exact).record())
        except Exception as err:  # noqa: BLE001 - the parent reports it
            conn.send(RuntimeError(f"{kind} of {node} on {spec}: {type(err).__name__}: {err}"))
