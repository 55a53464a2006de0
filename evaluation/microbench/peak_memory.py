"""Peak resident memory of a piece of work, from the kernel's own high-water mark (Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: peak memory needs Linux")


def peak_extra_bytes(work: Callable[[], T]) -> tuple[T, int]:
    """Run ``work()``; return its result and the most resident memory it added at any moment."""
    before = _reset_peak()
    result = work()
    return result, max(0, _status_kib("VmHWM") - before) * 1024


def peak_rss_bytes(work: Callable[[], T]) -> tuple[T, int]:
    """Run ``work()``; return its result and the process's peak resident memory while it ran."""
    _reset_peak()
    result = work()
    return result, _status_kib("VmHWM") * 1024


def _reset_peak() -> int:
    """Reset the high-water mark to the resident size now (KiB), which it returns."""
    _libc.malloc_trim(0)  # give freed heap back, so earlier work cannot hide this work's peak
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current resident size
    return _status_kib("VmRSS")
