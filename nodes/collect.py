"""One of Flower's servers (the SuperLink, a SuperNode) run in this process with its reference
cycles collected as its traffic flows: ``python -m nodes.collect SCRIPT ARGS...``.

Flower 1.42 serves its APIs through Starlette's ``BaseHTTPMiddleware``, whose request and the
stream of its body refer to each other: each request's body (a 5 MB chunk of a model or of a
reply) stays until Python's cyclic collector runs a full collection, which in a server of many
long-lived objects comes seldom. A volunteer's SuperNode grew by about 40 MB a round, round
after round (25.6M parameters, 3 volunteers: 133 MB idle, then 351 after 6 rounds, found
holding 29-42 such requests), whatever ``MALLOC_ARENA_MAX`` said; collected every 2 s, it
stayed at 139-155 MB between rounds. But a full collection over what such a server holds
takes 50-200 ms: every 2 s, the SuperLink spent 14% of a core and each SuperNode 4.5% while
the volunteers trained (measured at 100M parameters, 6 volunteers on 2 cores), time taken from
their training. So a thread looks every :data:`EVERY` seconds at the process's resident
memory and collects once it grew by :data:`BYTES` since the last collection (or since its
lowest point after it): a server collects while chunks pile up and not while it waits, and its
garbage holds at most about that much. (The bytes a process moved would say it better, but
Linux's ``/proc/self/io`` does not count a socket's ``send`` and ``recv``.) The objects the
server holds once started are frozen out of the collector's scans (``gc.freeze``,
:data:`START` seconds in). Elsewhere than Linux it collects every :data:`EVERY_BLIND` seconds.

The script is the console script Flower installs (``flower-superlink``, ``flower-supernode``),
run as ``__main__`` with its own arguments, so the process is that server in all else: its
command line still names the script (whoever looks for the process by name finds it).
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import threading
import time

START = 5.0  # seconds from the start to the first collection, which freezes what survives it
EVERY = 0.5  # seconds between looks at the resident memory
BYTES = 64 << 20  # growth of the resident memory that calls for a full collection
EVERY_BLIND = 2.0  # seconds between full collections where the resident memory is not known
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident() -> int | None:
    """This process's resident bytes, ``None`` where the system does not say."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def _collect() -> None:
    time.sleep(START)
    gc.collect()
    gc.freeze()  # what the server holds from its start (modules, app): never scanned again
    low, since = resident(), 0.0
    while True:
        time.sleep(EVERY)
        now, since = resident(), since + EVERY
        if now is None or low is None:
            due = since >= EVERY_BLIND
        else:
            low = min(low, now)
            due = now - low >= BYTES
        if due:
            gc.collect()
            low, since = resident(), 0.0


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m nodes.collect SCRIPT [ARGS...] (a console script of Flower's)")
    sys.argv = sys.argv[1:]
    threading.Thread(target=_collect, name="collect-cycles", daemon=True).start()
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
