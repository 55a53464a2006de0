"""Every rule uses at most one extra copy of its input at peak (measured, fresh process)."""

import json
import subprocess
import sys

import aggregators

N, D = 50, 1_000_000  # 200 MB of float32
SLACK = 48 * 2**20  # blocks, the (n, n) matrices, thread stacks, allocator rounding

PROBE = """
import json, sys, torch
import aggregators
from evaluation.microbench.aggregation_speed import round_inputs
from evaluation.microbench.peak_memory import peak_extra_bytes
X = torch.randn({n}, {d})
inputs = round_inputs(X)
out = {{}}
for spec in sys.argv[1:]:
    agg = aggregators.build(spec, f=2)
    result, peak = peak_extra_bytes(lambda: agg(X, inputs))
    del result
    out[spec] = peak
print(json.dumps(out))
"""


def test_peak_memory_is_at_most_one_copy_of_the_input():
    specs = aggregators.rules() + [f"{p}+mean" for p in aggregators.pre_aggregators()]
    specs += ["nnm+trimmed-mean", "arc+nnm+krum", "bucketing:s=2+bulyan"]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(n=N, d=D), *specs],
        capture_output=True, text=True, check=True,
    )
    peaks = json.loads(proc.stdout)
    input_bytes = N * D * 4
    over = {s: round(p / input_bytes, 2) for s, p in peaks.items() if p > input_bytes + SLACK}
    assert not over, f"peak extra memory above one input copy (x input): {over}"
    assert set(peaks) == set(specs)
