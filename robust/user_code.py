"""A user's own code, named ``package.module:attribute`` wherever a model or data set is named.

``model = "mylab.nets:make"`` names a factory ``make(shape, classes) -> nn.Module``;
``dataset = "mylab.data:load"`` a loader ``load() -> (x_train, y_train, x_test, y_test)``.
A folder (``--path DIR``, scenario key and setting ``code``) goes first on the import path.
Whatever goes wrong (no such module, no such attribute, not callable, the module raises on
import) is one line that names the string and what was expected.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

_NAME = r"[A-Za-z_]\w*"
REFERENCE = re.compile(rf"{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*")
PATH_HINT = "put its folder on the import path with --path DIR (scenario key and setting `code`)"


def is_reference(name: object) -> bool:
    """Whether ``name`` is written ``package.module:attribute``."""
    return isinstance(name, str) and REFERENCE.fullmatch(name) is not None


def use_path(folder: str) -> None:
    """Put ``folder`` first on the import path (once); ``ValueError`` if it is not a folder."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"code folder {folder!r} is not a folder: pass the folder that holds your modules")
    entry = str(path.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()


def resolve(reference: str, what: str, expected: str, folder: str = "") -> Callable:
    """The callable ``reference`` names (``folder`` first on the import path): ``what`` (e.g.
    "model") and ``expected`` (e.g. "factory(shape, classes) -> nn.Module") word the errors."""
    if not is_reference(reference):
        raise ValueError(f"{what} {reference!r}: write package.module:{expected.split('(')[0]}, "
                         f"a callable {expected}")
    if folder:
        use_path(folder)
    module_name, _, attribute = reference.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"{what} {reference!r}: no module named {err.name!r}: {PATH_HINT}") from None
    except Exception as err:  # the user's module failed as it was imported
        raise ValueError(f"{what} {reference!r}: importing {module_name} failed: {type(err).__name__}: {err}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {reference!r}: {module_name} has no attribute {attribute!r}; "
                             f"expected a callable {expected}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what} {reference!r} is a {type(target).__name__}, not a callable {expected}")
    return target
