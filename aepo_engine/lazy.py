"""Names a package re-exports from its torch modules, loaded on first use.

A package whose ``config.py`` holds a config section must not import torch in its ``__init__``
(the rule of ``aepo_engine.config``: reading the defaults loads no torch), yet callers write
``from aepo_engine.training import PolicyWorker``. The package sets ``__getattr__ =
lazy_exports(__name__, {...})``: the first look-up of a name imports its module, later ones are
plain attributes.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``.

    Args:
        package: the package's ``__name__``.
        homes: exported name -> the submodule that defines it (relative, e.g. ``".policy"``).

    Returns:
        The ``__getattr__``; an unknown name raises ``AttributeError`` (so ``from package import
        submodule`` still finds submodules).
    """
    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
