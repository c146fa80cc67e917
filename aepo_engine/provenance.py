"""Where a result came from: the commit of the code that produced it.

Benchmark rows (``bench/harness.py`` and the bench scripts) and the comparison grid's runs
(:mod:`aepo_engine.experiments.runner`) record it beside their figures. Nothing here imports more
than the standard library, so a kernel benchmark can ask without loading the engine.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git_commit"]


def git_commit(where: str | Path | None = None) -> str:
    """The short hash of the checkout's HEAD.

    Args:
        where: a path inside the checkout; default this file's, i.e. the code that runs.

    Returns:
        The hash, or "" outside a git checkout (an installed wheel) or without git.
    """
    folder = Path(where if where is not None else __file__).resolve()
    folder = folder if folder.is_dir() else folder.parent
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=folder, check=False)
    except OSError:  # no git
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
