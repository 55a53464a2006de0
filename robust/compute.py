"""The compute profile a task states, so that the same task gives the same bits anywhere.

A float reduction split over 2 threads adds in another order than over 1, so a model
trained with ``torch.get_num_threads() == 2`` differs in its last bits from one trained with
1. A task therefore names its intra-op thread count, and every computation whose bits matter
(a volunteer's training, the coordinator's round) runs inside :func:`profile`, which sets
that count, and on CUDA deterministic algorithms in full float32 precision, and restores
what it found on exit: no object changes process-global torch settings as a side effect of
being built.

Full precision matters on GPUs since Ampere: cuDNN convolutions run in TF32 by default (10
mantissa bits), so a GPU volunteer's honest CNN update differed from a CPU recomputation of it
by a relative 6.7e-3 (digits CNN on an H100), 67 times the spot checks' tolerance: 44 false
convictions in 1,000 checks. With TF32 off, the same checks stay within the tolerance.

Where a computation runs is chosen by :func:`resolve_device` from ``auto | cpu | cuda`` (the
coordinator's ``device`` setting, a volunteer's ``--device``): the same words, the same rule and
the same refusal everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
DEVICES = ("auto", "cpu", "cuda")  # what a device setting or option accepts


def resolve_device(choice: str, named: str = "device = ") -> torch.device:
    """The device ``choice`` names: ``auto`` is CUDA when torch sees a GPU, else the CPU;
    ``cuda`` without a GPU is a ``ValueError`` that says what to do (``named``: how the user
    wrote the choice, ``"device = "`` for a setting, ``"--device "`` for an option)."""
    if choice not in DEVICES:
        raise ValueError(f"{named}{choice!r}: choose auto, cpu or cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{named}cuda but torch sees no GPU: use {named}auto or cpu, "
                         "or install a CUDA build of PyTorch")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    """``cpu``, or ``cuda/<GPU name>``: what decides a computation's bits besides its code, as
    records and benchmark headers name it."""
    device = torch.device(device)
    return "cpu" if device.type == "cpu" else f"{device.type}/{torch.cuda.get_device_name(device)}"


def synced(device: torch.device, result: T) -> T:
    """``result``, once ``device`` has finished computing it: a CUDA call returns before its
    kernels end, so a timer stopped then would measure only the launches."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return result


@contextmanager
def profile(threads: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block with ``threads`` intra-op CPU threads (and, on CUDA, deterministic
    algorithms, no TF32); the previous settings come back afterwards, also on an exception."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1 (got {threads!r})")
    cuda = torch.device(device).type == "cuda"
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    before = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    benchmark = torch.backends.cudnn.benchmark
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(threads)
    if cuda:
        # cuBLAS reproducibility needs a fixed workspace (read when cuBLAS starts)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if cuda:
            torch.use_deterministic_algorithms(deterministic)
            torch.backends.cudnn.benchmark = benchmark
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
            if workspace is None:
                os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
