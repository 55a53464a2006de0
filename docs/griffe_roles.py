"""A griffe extension for the Python API page: the docstrings' reST roles as Markdown code.

robust's docstrings name code with reST roles (``:class:`FedAvg```, ``:meth:`start```); in
Markdown they would show as written. mkdocstrings loads this file (``mkdocs.yml``:
``extensions: [docs/griffe_roles.py]``) and every docstring it renders gets ```FedAvg```
instead. ``docs/gen_reference.py`` does the same for the component reference.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|obj|exc):`~?([^`]+)`")


class DocstringRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"``\1``", obj.docstring.value)
