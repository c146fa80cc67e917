"""No compiler, still runs: on a PATH without cc/gcc/g++ (as in ``python:3.11-slim``) the CPU loss
takes the eager path with one notice that says what it costs, and computes the same loss and
gradient. Run for real in a subprocess whose PATH holds every tool of this machine except the
compilers."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_COMPILER = re.compile(r"(.*-)?(gcc|g\+\+|cc|c\+\+|clang|clang\+\+|tcc|icc|icx|cpp)(-[0-9.]+)?|c[89]9-gcc")


def path_without_compilers(folder: Path) -> str:
    """A PATH of one folder linking every program on this PATH but the C/C++ compilers."""
    folder.mkdir(parents=True, exist_ok=True)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in sorted(Path(directory).iterdir()):
            link = folder / entry.name
            if not _COMPILER.fullmatch(entry.name) and not os.path.lexists(link):
                link.symlink_to(entry)
    return str(folder)


_CHILD = r"""
import shutil, warnings
import torch
assert shutil.which("cc") is None and shutil.which("g++") is None and shutil.which("gcc") is None
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from aepo_kernels import LossConfig, aepo_policy_loss
    from aepo_kernels import compile as kcompile, native
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 7, 301
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    old = torch.randn(B, T, generator=g) - 4.0
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    results = {}
    for backend in ("torch", "reference"):
        leaf = logits.clone().requires_grad_(True)
        loss, _ = aepo_policy_loss(leaf, labels, old, adv, mask, config=LossConfig(clip="aepo", entropy_adv_alpha=0.2),
                                   backend=backend, shift_labels=False)
        loss.backward()
        results[backend] = (loss.detach(), leaf.grad)
    torch.testing.assert_close(results["torch"][0], results["reference"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["torch"][1], results["reference"][1], rtol=1e-4, atol=1e-7)
    assert not kcompile.compile_enabled() and not native.enabled()
notices = [str(w.message) for w in caught if "aepo_kernels:" in str(w.message)]
assert len(notices) == 1, notices
print(notices[0])
"""


@pytest.mark.slow
def test_no_compiler_takes_the_eager_path_with_one_notice(tmp_path):
    env = {**os.environ, "PATH": path_without_compilers(tmp_path / "bin"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    for name in ("CC", "CXX", "AEPO_TORCH_COMPILE", "AEPO_CPU_NATIVE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notice = proc.stdout.strip()
    assert "no C++ compiler (g++, or $CXX) on PATH" in notice and "eager torch" in notice
    assert "no C compiler (cc, or $CC) on PATH" in notice and "several times slower" in notice
    assert "apt-get install gcc g++" in notice and "docs/benchmarks.md" in notice


def test_with_compilers_no_notice():
    from aepo_kernels.compile import c_compiler, cxx_compiler, toolchain_notice

    if cxx_compiler() is None or c_compiler() is None:
        pytest.skip("this machine lacks a C or C++ compiler")
    if os.environ.get("AEPO_TORCH_COMPILE") == "0" or os.environ.get("AEPO_CPU_NATIVE") == "0":
        pytest.skip("a switch turns a fast path off in this environment")
    assert toolchain_notice() is None
