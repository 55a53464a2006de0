"""How an update row travels: codecs built from the spec grammar.

    >>> import torch
    >>> from robust import codecs
    >>> codec = codecs.build("topk:k=0.01")
    >>> enc = codec.encode(torch.randn(1000))          # {"idx": int32 (10,), "val": float32 (10,)}
    >>> codec.decode(enc, 1000).shape, codecs.nbytes(enc), codec.ratio(1000)
    (torch.Size([1000]), 80, 50.0)

``none`` (float32), ``fp16``, ``int8:block=256``, ``topk:k=0.01`` (biased: encode with
:func:`error_feedback`), ``randk:k=0.01`` (unbiased, keyed), ``sign:block=128`` (1 bit per
coordinate, dense; biased: encode with :func:`error_feedback`; 25x fewer bytes and, unlike the
sparse codecs, within 1 pp of float32 under coordinate-wise robust rules) and
``shared-sign:share=0.25,block=128`` (``sign`` on a support the task announces, shared by
every node of it: 99x, keyed, biased). ``decode`` is the coordinator's gate for untrusted
input: anything malformed is a ``ValueError`` with a one-line reason; ``refusal`` says why an
encoding's claims do not answer its task.
"""

from __future__ import annotations

from robust.spec import parse

from . import fp16, int8, none, randk, shared_sign, sign, topk  # noqa: F401  (each module registers its codec)
from .base import REGISTRY, Codec, Encoded, Layout, nbytes
from .feedback import error_feedback

__all__ = ["Codec", "Encoded", "Layout", "build", "error_feedback", "names", "nbytes"]


def build(spec: str) -> Codec:
    """The codec described by ``spec`` (one component, e.g. ``"int8:block=128"``)."""
    components = parse(spec)
    if len(components) != 1:
        raise ValueError(f"a codec spec names one codec (got {spec!r}): drop the '+'")
    comp = components[0]
    return REGISTRY.lookup(comp.name, spec)(0, **comp.params)


def names() -> list[str]:
    """Every codec a spec may name, sorted."""
    return REGISTRY.names()
