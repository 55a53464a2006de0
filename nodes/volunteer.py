"""What a volunteer does with a task, with no Flower in sight: check it, train, sign.

The ClientApp (``nodes/client_app.py``) only decodes the message, calls :func:`work` and
encodes the result, so tests can run a volunteer's exact computation in-process.
A volunteer's batches are a function of ``(run seed, node fingerprint, round, step)``
(``robust.batches``): the same task gives the same update on the same hardware, whatever
else is running.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import attacks
from attacks.base import NodeAttack
from robust import keys
from robust.batches import draw_batches, node_key
from robust.models import build_model
from robust.params import sha256, unflatten
from robust.seeds import generator

from . import faults
from .protocol import Reply, Task, signed_payload
from .training import TrainConfig, local_update


@dataclass
class NodeData:
    """A volunteer's training set (what ``robust node join`` prepares once, in its folder)."""

    dataset: str
    x: torch.Tensor
    y: torch.Tensor
    classes: int

    def save(self, path: Path) -> None:
        torch.save({"dataset": self.dataset, "x": self.x, "y": self.y, "classes": self.classes}, path)

    @classmethod
    def load(cls, path: Path) -> NodeData:
        raw = torch.load(path, weights_only=True)
        return cls(raw["dataset"], raw["x"], raw["y"], int(raw["classes"]))


def pick_device(choice: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; ``cuda`` without a GPU is an error."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {choice!r}: choose auto, cpu or cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but PyTorch sees no CUDA device: use --device auto or cpu")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def check_attack(spec: str) -> None:
    """Raise ``ValueError`` unless ``spec`` is a protocol fault or a node-side attack."""
    if spec in ("", "none") or spec in faults.PROTOCOL_FAULTS:
        return
    if not isinstance(attacks.build(spec, 1), NodeAttack):
        raise ValueError(
            f"{spec!r} is an omniscient attack (it needs every node's update): a volunteer can play "
            f"node-side attacks ({', '.join(n for n in attacks.names() if isinstance(attacks.build(n, 1), NodeAttack))}) "
            f"or protocol faults ({', '.join(faults.PROTOCOL_FAULTS)})"
        )


def train_delta(task: Task, w: torch.Tensor, data: NodeData, node: str, device: torch.device,
                attack: str = "") -> torch.Tensor:
    """The model delta (CPU float32) of the task's local epochs of SGD with momentum from ``w``,
    on batches seeded by ``(seed, round, node, step)``; a node-side ``attack`` poisons the data
    and scales the delta. ``ValueError`` if ``w`` does not fit the model."""
    seed, round, batch_size = task.seed, task.round, task.batch_size
    model = build_model(task.model, tuple(data.x.shape[1:]), data.classes).to(device)
    params = unflatten(w.to(device), model)
    x, y, scale = data.x, data.y, 1.0
    if attack not in ("", "none"):
        node_attack = attacks.build(attack, 1)
        x, y = node_attack.poison(x, y, data.classes, generator(seed, node, "poison"))
        scale = node_attack.scale()
    steps = task.local_epochs * max(1, math.floor(len(y) / batch_size))
    idx = draw_batches([len(y)], batch_size, [node_key(seed, node)], round, steps)[0]
    cfg = TrainConfig(batch_size=batch_size, lr=task.lr, momentum=task.momentum, local_steps=steps)
    delta, _ = local_update(model, cfg, params, x[idx].to(device), y[idx].to(device), torch.zeros(()))
    return (delta * scale).detach().to("cpu", torch.float32)


def work(task: Task, w: np.ndarray, data: NodeData, key, device: torch.device,
         attack: str = "", folder: Path | None = None) -> tuple[Reply, np.ndarray | None]:
    """The signed reply to ``task`` with global weights ``w`` (or a refusal saying why)."""

    def refuse(reason: str) -> tuple[Reply, None]:
        return Reply(run=task.run, round=task.round, base=task.base, count=0, signature=b"", refused=reason), None

    if task.dataset != data.dataset:
        return refuse(f"this node holds {data.dataset}, the task trains on {task.dataset}: rejoin with --data {task.dataset}")
    weights = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    if sha256(weights) != task.base:
        return refuse("the model received does not match its announced SHA-256")
    node = keys.fingerprint(key.public_key())
    start = time.perf_counter()
    try:
        delta = train_delta(task, weights, data, node, device, "" if attack in faults.PROTOCOL_FAULTS else attack)
    except ValueError as err:  # the weights do not fit the model on this data
        return refuse(f"model {task.model} on {data.dataset}: {err}")
    seconds = time.perf_counter() - start
    row = faults.corrupt_row(attack, delta.numpy())
    count, base = faults.corrupt_fields(attack, len(data.y), task.base)
    update_sha = sha256(torch.from_numpy(row))
    signature = keys.sign(key, signed_payload(task.run, task.round, base, update_sha, count))
    reply = Reply(run=task.run, round=task.round, base=base, count=count, signature=signature, seconds=seconds)
    if folder is not None:
        reply, row = faults.corrupt_reply(attack, reply, row, folder)
    return reply, row
