"""Freed memory kept for reuse, so that a round's temporaries do not fault their pages in anew.

glibc's ``malloc`` serves a block of 128 KiB or more from a fresh ``mmap`` and, once freed,
hands it back to the kernel (or trims it off the heap's top): the next block of that size
faults every page in again and the kernel zeroes each one. A bench round makes dozens of
such temporaries (a float64 copy of a ``(25, 9738)`` update matrix is 1.9 MB), so a pass
of ``row_norms`` over it took 573 us, of which about 450 were page faults; with the freed
memory kept (blocks under 64 MiB from the heap, up to 128 MiB of free heap kept) it took
125 us. Larger blocks (a 100M-parameter model's rows) still come from ``mmap`` and go back.
Only the speed changes: the same bytes are computed. Elsewhere than glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
REUSE = 64 << 20  # blocks below this come from the heap and stay there once freed


def _glibc() -> ctypes.CDLL | None:
    """glibc, or ``None`` elsewhere (another system, another C library such as musl: its
    allocator, its rules)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def reuse_freed_memory() -> bool:
    """Keep freed blocks for reuse in this process (glibc only); whether it took effect."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, REUSE)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * REUSE))
