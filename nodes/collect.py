"""One of Flower's servers (the SuperLink, a SuperNode) run in this process with its reference
cycles collected every :data:`EVERY` seconds: ``python -m nodes.collect SCRIPT ARGS...``.

Flower 1.42 serves its APIs through Starlette's ``BaseHTTPMiddleware``, whose request and the
stream of its body refer to each other: each request's body (a 5 MB chunk of a model or of a
reply) stays until Python's cyclic collector runs a full collection, which in a server of many
long-lived objects comes seldom. A volunteer's SuperNode grew by about 40 MB a round, round
after round (25.6M parameters, 3 volunteers: 133 MB idle, then 351 after 6 rounds, found
holding 29-42 such requests), whatever ``MALLOC_ARENA_MAX`` said; collected every 2 s, it
stayed at 139-155 MB between rounds. A thread collects every :data:`EVERY` seconds, what the
garbage holds is then a few seconds of traffic; the objects the server holds once started
are frozen out of the collector's scans (``gc.freeze``): a full collection over Flower's
170,000 objects takes 50-200 ms, over what is not frozen well under a millisecond.

The script is the console script Flower installs (``flower-superlink``, ``flower-supernode``),
run as ``__main__`` with its own arguments, so the process is that server in all else: its
command line still names the script (whoever looks for the process by name finds it).
"""

from __future__ import annotations

import gc
import runpy
import sys
import threading
import time

EVERY = 2.0  # seconds between full collections


def _collect() -> None:
    time.sleep(EVERY)
    gc.collect()
    gc.freeze()  # what the server holds from its start (modules, app): never scanned again
    while True:
        time.sleep(EVERY)
        gc.collect()


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m nodes.collect SCRIPT [ARGS...] (a console script of Flower's)")
    sys.argv = sys.argv[1:]
    threading.Thread(target=_collect, name="collect-cycles", daemon=True).start()
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
