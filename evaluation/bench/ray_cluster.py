"""``robust bench --cluster ray``: the grid's cells as Ray tasks on every node of a running
Ray cluster (``pip install -e '.[cluster]'`` on the driver and on every node).

A cell is one task (one CPU): the same ``run_cell`` as ``--jobs``, so a cell's record and
``model_sha256`` are a local run's whatever node computes it and in whatever order cells end.
A task whose node dies is run again on another (Ray's ``max_retries``, system failures only);
a cell that fails in Python fails the grid with its node and error. Every task checks that its
node runs the driver's versions of robust, torch and numpy, since a cell's bits are only
comparable between equal ones.

Address: ``--cluster ray`` connects to ``RAY_ADDRESS`` (else the cluster started on this
machine by ``ray start``); ``--cluster ray://HOST:PORT`` connects through Ray Client. On a
loopback address every connection stays on 127.0.0.1: by default Ray rewrites 127.0.0.1 to
the machine's outward address when a driver connects.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Callable
from urllib.parse import urlsplit

from .cell import Cell

RETRIES = 3  # a cell whose node dies is run again, at most this many times
CLIENT_ATTEMPTS = 3  # connections through Ray Client (ray://), each asked anew if the last failed
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def address(spec: str) -> str:
    """The address ``ray.init`` gets for ``--cluster SPEC``: ``ray`` (RAY_ADDRESS, else the
    cluster ``ray start`` left on this machine) or ``ray://HOST:PORT``."""
    if spec == "ray":
        return os.environ.get("RAY_ADDRESS") or "auto"
    if spec.startswith("ray://") and urlsplit(spec).port:
        return spec
    raise ValueError(f"--cluster must be ray or ray://HOST:PORT (got {spec!r}); "
                     "`ray` connects to RAY_ADDRESS, e.g. RAY_ADDRESS=10.0.0.5:6379")


def _host_port(target: str) -> tuple[str | None, int | None]:
    parts = urlsplit(target if "://" in target else f"//{target}")
    return parts.hostname, parts.port


def _reachable(target: str) -> None:
    """Fail at once when nothing listens at ``target`` (Ray's own connect retries for minutes)."""
    host, port = _host_port(target)
    if host is None or port is None:
        return  # "auto": Ray looks for a cluster on this machine and says when there is none
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError as err:
        raise ConnectionError(err.strerror or str(err)) from None


def connect(spec: str):
    """Connect this process to the cluster as its driver; return the ``ray`` module."""
    target = address(spec)
    try:
        import ray
        from ray._private import ray_constants
    except ImportError:
        raise RuntimeError("--cluster ray needs Ray: pip install -e '.[cluster]'") from None
    if _host_port(target)[0] in LOOPBACK:
        # off, a node's own address is 127.0.0.1 (Ray's switch for machines without cluster support)
        ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray Client's proxy starts a server process for each connection, and on a loaded head that
    # start can time out ("SpecificServer startup failed"): a client connection is asked again
    for attempt in range(CLIENT_ATTEMPTS if target.startswith("ray://") else 1):
        try:
            _reachable(target)
            with warnings.catch_warnings():  # a tip about GPUs on tasks that ask for none, every run
                warnings.simplefilter("ignore", FutureWarning)
                ray.init(address=target, log_to_driver=False, logging_level="warning")
            return ray
        except ConnectionError as err:
            ray.shutdown()
            failure = err
            print(f"robust bench: connecting to {target} failed (try {attempt + 1}): {err}", file=sys.stderr)
    raise RuntimeError(f"no Ray cluster at {target} ({failure}); start one with `ray start --head` "
                       "and set RAY_ADDRESS, or give --cluster ray://HOST:PORT") from None


def versions() -> dict[str, str]:
    """What a node must share with the driver for its cells to give the driver's bits."""
    import numpy
    import torch

    from robust import __version__

    return {"robust": __version__, "torch": torch.__version__, "numpy": numpy.__version__}


def node_label(ray) -> str:
    """A node as the progress shows it: its address and the start of its Ray id."""
    context = ray.get_runtime_context()
    return f"{ray.util.get_node_ip_address()}/{context.get_node_id()[:6]}"


def _task(work: Callable[[Cell, str], dict], cell: Cell, engine: str, want: dict[str, str]) -> tuple[dict, str]:
    import ray

    have = versions()
    if have != want:
        raise RuntimeError(f"node {node_label(ray)} runs {have}, the driver {want}: install the same versions there")
    return work(cell, engine), node_label(ray)


def run_cells(todo: list[Cell], engine: str, spec: str, work: Callable[[Cell, str], dict],
              save: Callable[[dict, str], None]) -> None:
    """Run ``work(cell, engine)`` for each cell of ``todo`` as a task on the cluster (``work``
    is the local run's own function, found by name on each node); ``save(record, node)`` each
    as it ends."""
    if not todo:
        return
    ray = connect(spec)
    try:
        task = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_task)
        want = versions()
        cells = {task.remote(work, cell, engine, want): cell for cell in todo}
        pending = list(cells)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    record, node = ray.get(done[0])
                except ray.exceptions.RayError as err:
                    cell, cause = cells[done[0]], getattr(err, "cause", None) or err
                    raise RuntimeError(f"cell {cell.aggregator} vs {cell.attack} seed {cell.seed} failed "
                                       f"on the cluster: {cause}") from None
                save(record, node)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
    finally:
        ray.shutdown()
