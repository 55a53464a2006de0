"""``python -m evaluation.spot_tolerance``: calibrate the spot checks' tolerance, how far apart two
honest computations of one task are. A thin entry: the work is ``evaluation.microbench.recompute_distance``."""

import sys

from evaluation.microbench.recompute_distance import main

if __name__ == "__main__":
    sys.exit(main())
