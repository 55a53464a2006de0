"""``python -m evaluation.portable``: a portable CPU profile, which settings give one x86 CPU's
bits on another and at what cost. A thin entry: the work is ``evaluation.microbench.portable_profile``."""

import sys

from evaluation.microbench.portable_profile import main

if __name__ == "__main__":
    sys.exit(main())
