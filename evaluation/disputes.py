"""``python -m evaluation.disputes``: refereed disputes across compute profiles, measured. A thin
entry: the work is ``evaluation.microbench.dispute_grid``."""

import sys

from evaluation.microbench.dispute_grid import main

if __name__ == "__main__":
    sys.exit(main())
