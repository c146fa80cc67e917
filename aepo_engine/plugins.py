"""Code of the user's own, outside the package, named in a config and imported (as verl's
``custom_reward_function.path``): ``reward.path`` names a Python file or an importable module
whose ``@register_reward`` functions join the registry before ``reward.name`` is looked up.

A file is imported once per process under a name derived from its resolved path, so building the
reward twice (the trainer and the dry run, each rank) does not register it twice.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["import_user_code"]


def import_user_code(spec: str, setting: str) -> ModuleType:
    """Import ``spec``: a ``.py`` file (absolute, or relative to the working directory) or a
    dotted module name on ``sys.path``.

    Args:
        spec: the file or module.
        setting: the config key that named it, for the error message (``reward.path``).

    Returns:
        The imported module.

    Raises:
        ValueError: no such file or module, or its import failed (the cause is named).
    """
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{setting} = {spec!r}: no such file ({path})")
        name = f"aepo_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise ValueError(f"{setting} = {spec!r}: importing it failed: {type(err).__name__}: {err}") from err
        return module
    try:
        return importlib.import_module(spec)
    except Exception as err:
        raise ValueError(f"{setting} = {spec!r}: importing it failed: {type(err).__name__}: {err}") from err
