"""A decoder-only transformer over bytes: ``gpt:layers=L,width=W,heads=H,context=C``.

GPT-2's block (Radford et al. 2019, "Language models are unsupervised multitask learners"):
pre-LayerNorm, causal multi-head self-attention and a 4x-wide GELU MLP, each added to the
residual stream; learned token and position embeddings; a final LayerNorm and a linear head
over the 256 byte values (``robust.text``). No dropout (an update stays a function of its
task), no weight tying (every trained parameter is its own). Initialised as GPT-2: weights
``N(0, 0.02)``, the residual projections ``N(0, 0.02 / sqrt(2 L))``, biases 0.

Its output is the logits shaped ``(batch, vocabulary, positions)``: the class dimension
second, as ``torch.nn.functional.cross_entropy`` takes it against targets ``(batch,
positions)``, and as ``argmax(dim=1)`` gives the next-byte prediction at every position (the
engine's accuracy is then next-token accuracy). Attention is written with matrix products
and a fixed causal mask, so ``torch.func.vmap`` trains many nodes' models at once.

Presets: ``gpt-tiny`` = ``gpt:layers=2,width=64,heads=4,context=64`` (137k parameters: grids
on 2 cores), ``gpt-small`` = ``gpt:layers=6,width=384,heads=6,context=256`` (10.8M),
``gpt-100m`` = ``gpt:layers=14,width=768,heads=12,context=1024`` (100.5M).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .constraints import Interval, Param, check_all, table
from .spec import parse

PARAMS = table(
    Param("layers", Interval(int, 1, None), 2, "transformer blocks"),
    Param("width", Interval(int, 1, None), 64, "the residual stream's width"),
    Param("heads", Interval(int, 1, None), 4, "attention heads (they divide the width)"),
    Param("context", Interval(int, 1, None), 64, "the longest sequence it reads, in bytes"),
)
PRESETS = {
    "gpt-tiny": "gpt:layers=2,width=64,heads=4,context=64",
    "gpt-small": "gpt:layers=6,width=384,heads=6,context=256",
    "gpt-100m": "gpt:layers=14,width=768,heads=12,context=1024",
}
VOCAB = 256
# What a language model trains with where the run leaves it unset (``robust.models.training_defaults``):
# 4 local AdamW steps a round, each step's gradient clipped at norm 1, AdamW's learning rate.
TRAINING = {"protocol": "delta:steps=4,inner=adamw,clip=1.0", "lr": 0.003}


def is_gpt(name: str) -> bool:
    return name in PRESETS or name == "gpt" or name.startswith("gpt:")


def config(name: str) -> dict:
    """The checked ``layers, width, heads, context`` of a preset or a ``gpt:...`` spec;
    ``ValueError`` in the project's one format."""
    [spec] = parse(PRESETS.get(name, name))
    if spec.name != "gpt":
        raise ValueError(f"model {name!r}: write gpt:layers=L,width=W,heads=H,context=C or one of {', '.join(PRESETS)}")
    values = check_all("model gpt", PARAMS, spec.params)
    if values["width"] % values["heads"]:
        raise ValueError(f"model {name!r}: heads={values['heads']} must divide width={values['width']}")
    return values


def count(layers: int, width: int, heads: int, context: int, vocab: int = VOCAB) -> int:
    """Trained parameters of ``gpt:...`` (without building it)."""
    block = 2 * 2 * width + (width * 3 * width + 3 * width) + (width * width + width) \
        + (width * 4 * width + 4 * width) + (4 * width * width + width)
    return vocab * width + context * width + layers * block + 2 * width + (width * vocab + vocab)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, t, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(width, dim=-1)
        q, k, v = (z.reshape(batch, t, self.heads, width // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads) + mask
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, t, width)
        h = h + self.proj(attended)
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class GPT(nn.Module):
    """``recompute``: keep only each block's input through the forward pass and recompute the
    block's activations in the backward pass (``torch.utils.checkpoint``): the activations of
    one block held at a time instead of all of them (at 100M parameters, batch 8 of 128 bytes:
    about 1 GB less) for one more forward pass; the same bits. Set by
    ``robust.models.recomputing`` around an autograd gradient (``torch.func`` transforms do not
    take it)."""

    recompute = False

    def __init__(self, layers: int, width: int, heads: int, context: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.empty(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.full((context, context), float("-inf")).triu(1), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" not in name:
                residual = name.endswith(("proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        h = self.tokens(x.long()) + self.positions[:t]
        mask = self.mask[:t, :t].to(h.dtype)
        again = self.recompute and torch.is_grad_enabled()
        for block in self.blocks:
            h = checkpoint(block, h, mask, use_reentrant=False) if again else block(h, mask)
        return self.head(self.norm(h)).transpose(1, 2)


def build(name: str, shape: tuple[int, ...], classes: int) -> GPT:
    """The model ``name`` for samples of ``shape`` (``(T,)`` bytes) and ``classes`` (256) values;
    the caller seeds the RNG."""
    c = config(name)
    if len(shape) != 1 or classes != VOCAB:
        raise ValueError(f"model {name!r} reads byte sequences (a text data set: pystdlib, text); this data set's "
                         f"samples are {tuple(shape)} with {classes} classes")
    if shape[0] > c["context"]:
        raise ValueError(f"model {name!r} reads at most {c['context']} bytes, the samples hold {shape[0]}: give the "
                         f"data set a shorter context (e.g. dataset = \"pystdlib:context={c['context']}\") or the "
                         "model a longer one")
    return GPT(c["layers"], c["width"], c["heads"], c["context"])
