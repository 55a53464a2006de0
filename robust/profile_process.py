"""A process at a compute profile (``robust.profiles``): where a computation runs at another
CPU level than this process's.

PyTorch reads ``ATEN_CPU_CAPABILITY`` and ``DNNL_MAX_CPU_ISA`` once, when it starts, so a level
needs a fresh interpreter started with them (``spawn``). :func:`start` starts one (its
environment is this one's plus the profile's); :class:`Remote` calls module-level functions in
it, arguments and results pickled over a pipe (tensors by value), one call at a time: the
coordinator's own recomputations at its ``referee-profile``.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable

from .profiles import Profile


def start(profile: Profile, target: Callable, args: tuple = ()):
    """``(process, the parent's end of its pipe)``: ``target(child's end, *args)`` in a fresh
    interpreter started with ``profile``'s environment; a daemon (it dies with us)."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    with _ENV:  # the child's environment is copied from ours as it starts
        saved = dict(os.environ)
        os.environ.update(profile.env())
        try:
            proc = context.Process(target=target, args=(child, *args), daemon=True)
            proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    child.close()
    return proc, conn


_ENV = threading.Lock()


class Remote:
    """Module-level functions called in a process at ``profile``; started at the first call."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.proc = None
        self.conn = None

    def __call__(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` in the profile's process; its exception is raised here."""
        if self.proc is None or not self.proc.is_alive():
            self.proc, self.conn = start(self.profile, _serve)
        try:
            self.conn.send((fn, args, kwargs))
            kind, value = self.conn.recv()
        except (EOFError, OSError) as err:  # it died (killed, out of memory): a fresh one next call
            self.proc = None
            raise RuntimeError(f"the process at compute profile {self.profile.spec} ended while computing "
                               f"{getattr(fn, '__name__', fn)} ({type(err).__name__}): see the log above") from None
        if kind == "error":
            raise value
        return value

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = None


def here(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` in this process: a :class:`Remote`'s stand-in at this process's own level."""
    return fn(*args, **kwargs)


def runner(profile: Profile) -> Callable:
    """Where computations at ``profile`` run: this process (its own level, or the GPU), or a
    :class:`Remote` (a capped CPU level)."""
    return Remote(profile) if profile.env() else here


def _serve(conn) -> None:
    while (request := conn.recv()) is not None:
        fn, args, kwargs = request
        try:
            conn.send(("value", fn(*args, **kwargs)))
        except Exception as err:  # noqa: BLE001 - raised in the caller
            conn.send(("error", err))
