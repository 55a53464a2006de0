"""A probe in Flower's SuperLink, for ``python -m evaluation.flower_memory`` only.

Python imports ``sitecustomize`` from the first folder of its path that has one; the harness
puts this folder first on ``PYTHONPATH`` for the deployment it measures, so every Python
process of it imports this file, and all but the SuperLink return at once. In the SuperLink
(``flower-superlink``), it records the object store Flower makes, and a thread samples it (Flower 1.42's
``InMemoryObjectStore``: every task and reply object it keeps, content-addressed) every 50 ms
and writes the most bytes it held to the file ``$ROBUST_STORE_PEAK``: what Flower holds,
exactly, where the process's resident memory also counts Python's and the allocator's slack.
"""

import os
import threading
import time

SAMPLE = 0.05  # seconds


def _watch(stores: list, path: str) -> None:
    peak = -1
    while True:
        time.sleep(SAMPLE)
        for store in stores:
            with store.lock_store:
                held = sum(len(entry.content) for entry in store.store.values())
            if held > peak:
                peak = held
                with open(path + ".tmp", "w") as out:
                    out.write(f"{peak}\n")
                os.replace(path + ".tmp", path)


def _probe(path: str) -> None:
    """Record every object store the SuperLink makes (a heap scan instead would hold references
    to objects under construction in other threads: CPython then fails to resize a tuple)."""
    from flwr.supercore.object_store import in_memory_object_store as module

    stores, made = [], module.InMemoryObjectStore.__init__

    def recorded(self, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        stores.append(self)

    module.InMemoryObjectStore.__init__ = recorded
    threading.Thread(target=_watch, args=(stores, path), daemon=True).start()


def _is_superlink() -> bool:
    """Whether this process is the SuperLink (run as Flower's script, or by ``nodes.collect``)."""
    with open("/proc/self/cmdline", "rb") as cmdline:
        return any(arg.endswith(b"flower-superlink") for arg in cmdline.read().split(b"\0"))


if os.environ.get("ROBUST_STORE_PEAK") and _is_superlink():
    _probe(os.environ["ROBUST_STORE_PEAK"])
