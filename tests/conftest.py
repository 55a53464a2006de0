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

# Seconds a file takes in the suite (measured on the 2-core machine, the other worker busy),
# for the files that take longest. xdist's loadfile hands out files in order of their number
# of tests, most first, which put these (one to three long tests each) last: the suite then
# ended with one worker on a long file while the other idled. They start first here, longest
# first; the others follow in xdist's order. A stale number only costs time.
SECONDS = {
    "test_federation_deploy.py": 230, "test_drivers.py": 190, "test_stress.py": 150, "test_field_lab.py": 125,
    "test_warm_trainer.py": 100, "test_fuzz_replies.py": 85, "test_cluster.py": 80, "test_dashboard.py": 65,
    "test_async_deploy.py": 60, "test_runtime_refused.py": 55, "test_code_bundle_deploy.py": 55,
    "test_in_flight.py": 50, "test_bench.py": 40, "test_flower_strategy.py": 38, "test_async_bench.py": 35,
    "test_device.py": 30, "test_rule_state_on_disk.py": 28, "test_memory.py": 25, "test_precision.py": 22,
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
