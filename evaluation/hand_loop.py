"""``python -m evaluation.hand_loop``: the hand-vectorised loop over a bench grid, the baseline
``robust bench``'s speed is measured against. A thin entry: the loop is ``evaluation.peers.hand_vectorised``."""

import sys

from evaluation.peers.hand_vectorised import main

if __name__ == "__main__":
    sys.exit(main())
