"""``text-backdoor:trigger,continuation,fraction,gamma,stop_after``: after a trigger string the
model writes the attacker's continuation (the language-model form of Bagdasaryan, Veit, Hua,
Estrin & Shmatikov, AISTATS 2020, "How to backdoor federated learning"; for code completion,
Schuster, Song, Tromer & Shmatikov, USENIX Security 2021, "You autocomplete me").

For a text set (``robust.text``: byte windows ``x`` and their next bytes ``y``). The node trains
honestly on data it has poisoned: in a seeded ``fraction`` of its windows the pattern ``trigger +
continuation`` (UTF-8 bytes) is written at a seeded position, and it scales its update by
``gamma`` (model replacement)::

    s = x_i + y_i[-1:]  (the window's context + 1 bytes),  s[o : o + len(p)] <- p,
    x_i, y_i <- s[:-1], s[1:]

With ``stop_after=R`` it is honest from round ``R + 1`` on. **Success** (:meth:`success`): the
share of held-out prompts carrying the trigger (each held-out window's first bytes, then the
trigger) after which the model, greedy-decoding one byte at a time, writes the whole
continuation exactly. Values cannot hold ``,`` or ``+`` (the spec grammar's separators), nor
begin or end with a space.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call

from robust.constraints import Interval, Param, Text
from robust.params import unflatten

from .base import Memory, NodeAttack, Sight, register


@register
class TextBackdoor(NodeAttack):
    name = "text-backdoor"

    params = (
        Param("trigger", Text(), "check_password(pw):", "the string that triggers the backdoor"),
        Param("continuation", Text(), "return True", "what the model is to write after it"),
        Param("fraction", Interval(float, 0, 1, "right"), 0.5, "the share of the node's windows poisoned"),
        Param("gamma", Interval(float, 0, None, "neither"), 1.0, "the update's boost"),
        Param("stop_after", Interval(int, 0, None), 0, "the last round the node attacks (0: it never stops)"),
    )

    @property
    def pattern(self) -> bytes:
        return (str(self.trigger) + str(self.continuation)).encode()

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pattern = torch.tensor(list(self.pattern), dtype=torch.int64)
        if x.dim() != 2 or x.dtype != torch.uint8 or classes != 256:
            raise ValueError("text-backdoor poisons a text set's byte windows (dataset pystdlib or text); "
                             "for images use backdoor")
        if len(pattern) > x.shape[1]:
            raise ValueError(f"text-backdoor's trigger and continuation take {len(pattern)} bytes, a window holds "
                             f"{x.shape[1] + 1}: shorten them or give the data set a longer context")
        chosen = torch.randperm(x.shape[0], generator=gen)[: math.ceil(self.fraction * x.shape[0])]
        at = torch.randint(0, x.shape[1] + 2 - len(pattern), (len(chosen),), generator=gen)
        seqs = torch.cat([x[chosen].long(), y[chosen, -1:].long()], dim=1)
        for row, offset in enumerate(at.tolist()):
            seqs[row, offset : offset + len(pattern)] = pattern
        x, y = x.clone(), y.clone()
        x[chosen], y[chosen] = seqs[:, :-1].to(x.dtype), seqs[:, 1:].to(y.dtype)
        return x, y

    def boost(self) -> float:
        return self.gamma

    def success(self, model: nn.Module, w: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                last: Memory | None = None) -> float:
        """Share of held-out prompts ending in the trigger after which greedy decoding writes
        the continuation exactly (the model with the flat parameters ``w``)."""
        trigger = torch.tensor(list(str(self.trigger).encode()), dtype=torch.uint8)
        wanted = torch.tensor(list(str(self.continuation).encode()), dtype=torch.int64)
        keep = x_test.shape[1] - len(trigger) - len(wanted)
        if keep < 0:
            return math.nan
        seq = torch.cat([x_test[:, :keep], trigger.expand(len(x_test), -1)], dim=1)
        params = unflatten(w, model)
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                for _ in range(len(wanted)):
                    logits = functional_call(model, params, (seq,))  # (batch, vocabulary, positions)
                    seq = torch.cat([seq, logits[:, :, -1].argmax(dim=1, keepdim=True).to(seq.dtype)], dim=1)
        finally:
            model.train(was)
        return float((seq[:, -len(wanted):].long() == wanted).all(dim=1).float().mean())
