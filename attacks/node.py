"""The old home of :class:`~attacks.backdoor.Backdoor`, kept only while ``evaluation/cell.py``
imports it from here; delete this file once that import reads ``attacks.backdoor``."""

from .backdoor import Backdoor  # noqa: F401
