"""Suite-wide settings for the test run: how its processes wait, and which files start first.

Neither changes what any test computes or checks; both change only how long the suite takes
on a small machine (``python -m pytest -q -n 2 --dist loadfile``: two workers, a file each).
"""

from __future__ import annotations

import os

# OpenMP threads (PyTorch's, every process of the suite: the workers and all they start) that
# wait for work sleep instead of spinning. Two workers' processes share two cores: a spinning
# thread holds a core the other process's thread needs, and a parallel op waits out the
# scheduler's time slices (test_memory's probe took 119 s next to a busy process, 21 s with
# this; alone, 12 s either way). The same threads split the same work: the same bits. Set
# before torch is imported here (the variable is read when its OpenMP runtime loads); a value
# already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Seconds a file takes in the suite (measured on the 2-core machine, beside the other worker),
# for the files that take longest. xdist's loadfile hands out files in order of their number
# of tests, most first, which put these (one to three long tests each) last: the suite then
# ended with one worker on a long file while the other idled. They start first here, longest
# first; the others follow in xdist's order. A stale number only costs time.
SECONDS = {
    "test_federation_deploy.py": 205, "test_drivers.py": 115, "test_stress.py": 105, "test_field_lab.py": 85,
    "test_warm_trainer.py": 70, "test_cluster.py": 70, "test_dashboard.py": 65, "test_async_deploy.py": 52,
    "test_code_bundle_deploy.py": 48, "test_runtime_refused.py": 48, "test_in_flight.py": 45,
    "test_flower_strategy.py": 40, "test_bench.py": 32, "test_memory.py": 15, "test_precision.py": 15,
    "test_fuzz_replies.py": 14, "test_coordinator_holds.py": 12, "test_device.py": 11, "test_params_common.py": 11,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist: files in the order collected (below)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """The long files first, longest first; then the others, most tests first (xdist's own
    order); a file's tests stay together and in their order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(path: str) -> tuple:
        return (-SECONDS.get(os.path.basename(path), 0), -len(files[path]))

    items[:] = [item for path in sorted(files, key=cost) for item in files[path]]
