"""``python -m evaluation.device_speed``: the bench on a GPU beside the CPU. A thin entry: the work is
``evaluation.microbench.gpu_vs_cpu``."""

import sys

from evaluation.microbench.gpu_vs_cpu import main

if __name__ == "__main__":
    sys.exit(main())
