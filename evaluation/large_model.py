"""``python -m evaluation.large_model``: a model of over 10M parameters in the bench and in a
deployment on loopback, its memory measured. A thin entry: the work is ``evaluation.field.large_model_memory``."""

import sys

from evaluation.field.large_model_memory import main

if __name__ == "__main__":
    sys.exit(main())
