"""``python -m evaluation.flower_memory``: what Flower's SuperLink and the coordinator's ServerApp hold
per round, for ``n`` volunteers. A thin entry: the work is ``evaluation.field.superlink_memory``."""

import sys

from evaluation.field.superlink_memory import main

if __name__ == "__main__":
    sys.exit(main())
