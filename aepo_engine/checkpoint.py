"""Atomic, verified, resumable training checkpoints.

Layout under ``root``::

    root/
      latest                   one line: the name of the newest complete checkpoint (written last)
      step_000123/
        train_state/           torch.distributed.checkpoint (DCP): model + optimizer (FQN-keyed, so
                               FSDP2-sharded modules save/load shard-wise and may reshard), scheduler,
                               step, extra state (sampler, metrics) and each rank's RNG states
        hf_model/              the model for ``from_pretrained`` in its own dtype (safetensors +
                               config + tokenizer), when asked for (``CheckpointConfig.hf_export_every``);
                               under LoRA the adapter merged into the base weights
        adapter/               under LoRA, with hf_model/: the adapter alone (PEFT's format)
        config.toml            the resolved run config
        meta.json              step, time, world size and every other file's size and XXH3-64
                               checksum (written last inside the directory)

A save writes into ``step_000123.tmp-<uuid>/``, records the files it wrote in ``meta.json``, fsyncs
every file and directory, renames it to ``step_000123/`` and only then replaces ``latest`` (temp file +
``os.replace``). A crash at any point leaves the previous checkpoint named by ``latest`` and intact;
leftover ``*.tmp-*`` directories are ignored by loading and deleted by the next manager. A save that
fails (a full disk: :class:`CheckpointSaveError` says the step, the bytes needed and free, and the
checkpoint a resume will use) removes its temporary directory. The newest ``keep_last`` checkpoints
are kept, never the one ``latest`` names, and a checkpoint found damaged does not count as kept.

Resuming (:meth:`CheckpointManager.resume`) checks each file's size and checksum first (collective:
each rank reads a share of the files); a damaged checkpoint is skipped for the newest intact one
(``LoadedCheckpoint.skipped`` says which and why), and :class:`CheckpointDamaged` says the choices
when none is intact or an explicitly named one is damaged. Checkpoints saved before checksums were
recorded (format 1) load unverified.

Under LoRA (``models.lora``) train_state holds the adapter and its optimizer state only (the frozen
base weights are the model's own files, read again at resume).

Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict`` and the ``set_*`` twins), which handle plain modules and FSDP2 alike. The
HF export gathers a full state dict (``full_state_dict=True, cpu_offload=True``; collective under
FSDP2) and rank 0 writes it. Without an initialized process group everything runs single-process.
Left out: async saving and uploading to remote storage.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from aepo_engine import distributed
from aepo_engine.faults import fault_point
from aepo_engine.models.lora import ADAPTER_NAME, adapter_scalings, has_adapter, merged_state, write_adapter
from aepo_engine.sections import CheckpointConfig  # re-exported: its old home
from aepo_engine.files import (CHECKSUM, TMP_TAG, file_checksum, format_bytes, free_bytes, fsync_dir, fsync_tree,
                               out_of_space, storage_error, tree_bytes, write_text_atomic)

__all__ = [
    "CheckpointConfig", "CheckpointDamaged", "CheckpointFootprint", "CheckpointManager", "CheckpointSaveError",
    "HF_EXPORT", "LoadedCheckpoint", "capture_rng_state", "checkpoint_footprint", "find_latest", "list_checkpoints",
    "model_dtype", "restore_rng_state", "resume_candidates", "space_problem", "verify_checkpoint",
]

# --- errors ---------------------------------------------------------------------------------------

class CheckpointSaveError(OSError):
    """A checkpoint could not be written (a full disk, an I/O error); the message says the step,
    the bytes needed and free, and the intact checkpoint a resume will use. Its temporary
    directory is removed and the previous checkpoints are untouched."""


class CheckpointDamaged(ValueError):
    """Resuming found no intact checkpoint, or the one named is damaged; the message names the
    damaged file and the choices (another checkpoint, or ``--checkpoint.resume never``)."""


class _Rank0Failed(RuntimeError):
    """What the other ranks raise when rank 0's part of a save failed (rank 0 raises the original)."""


# --- layout ---------------------------------------------------------------------------------------

LATEST = "latest"
META = "meta.json"
HF_EXPORT = "hf_model"  # the model for from_pretrained, inside a checkpoint
ADAPTER_EXPORT = "adapter"  # under LoRA: the adapter for peft.PeftModel.from_pretrained, beside hf_model/
STEP_DIR = re.compile(r"^step_(\d{6,})$")
DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # the data file a rank wrote (DCP's FileSystemWriter)
FORMAT_VERSION = 2  # 2: meta.json lists every file with its size and checksum
OPTIMIZER_STATE_FACTOR = 2  # AdamW's two fp32 moments per parameter
RESUME_CHOICES = "resume from another checkpoint (--checkpoint.resume PATH) or start fresh (--checkpoint.resume never)"


@dataclass
class LoadedCheckpoint:
    """What ``load`` restored besides the model/optimizer/scheduler it was given.

    Attributes:
        path: the checkpoint directory.
        step: the training step it was saved at.
        extra_state: the ``extra_state`` dict given to ``save`` (sampler state, metrics, ...).
        config_text: the saved config (TOML), or None.
        skipped: the damaged checkpoints passed over before this one, each with its first problem.
    """

    path: Path
    step: int
    extra_state: dict[str, Any] = field(default_factory=dict)
    config_text: str | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when no process group exists; that is intended."""
    with warnings.catch_warnings():
        if not distributed.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- RNG ------------------------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """Return this process's RNG states: python ``random``, numpy's global RNG, torch CPU and CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
    with contextlib.suppress(ImportError):
        import numpy as np

        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore states from ``capture_rng_state``; CUDA states only if CUDA is available here."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    # Our own file; it holds RNG tuples, numpy arrays and user dicts, which weights_only rejects.
    return torch.load(io.BytesIO(data), weights_only=False)


# --- HF export ------------------------------------------------------------------------------------

def model_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype a Hugging Face model directory's ``config.json`` declares (``dtype``, or the older
    ``torch_dtype``): the dtype its HF export is written in. None when it declares none."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (collective under FSDP2: every rank must call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _export_hf(out_dir: Path, model: torch.nn.Module, tokenizer: Any, full_state: dict,
               dtype: torch.dtype | None = None) -> None:
    """Rank 0 writes the model (and tokenizer) as a ``from_pretrained`` directory, its floating
    tensors in ``dtype`` (None: as they are)."""
    out_dir.mkdir(parents=True)
    if has_adapter(full_state):  # LoRA: the adapter as PEFT writes it, beside the merged model
        write_adapter(out_dir.parent / ADAPTER_EXPORT, full_state, model.peft_config[ADAPTER_NAME], dtype=dtype)
        full_state = merged_state(full_state, adapter_scalings(model))
    if dtype is not None:
        for key in list(full_state):  # one tensor at a time: the fp32 copy is freed as it goes
            if full_state[key].is_floating_point():
                full_state[key] = full_state[key].to(dtype)
    if hasattr(model, "save_pretrained"):  # from_pretrained re-ties what the config says is tied
        model.save_pretrained(out_dir, state_dict=_drop_tied_repeats(model, full_state))
        if dtype is not None:  # save_pretrained writes the dtype of the parameters it holds (fp32)
            config_path = out_dir / "config.json"
            config = json.loads(config_path.read_text(encoding="utf-8"))
            config["dtype"] = str(dtype).removeprefix("torch.")
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    else:
        from safetensors.torch import save_file

        save_file(_unshare(full_state), str(out_dir / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def _write_rank0_files(tmp: Path, model: torch.nn.Module, tokenizer: Any, full_state: dict | None,
                       hf_dtype: torch.dtype | None, config_text: str | None) -> None:
    """Rank 0's part of a checkpoint: the HF export (when ``full_state`` is given) and config.toml."""
    if full_state is not None:
        _export_hf(tmp / HF_EXPORT, model, tokenizer, full_state, hf_dtype)
    if config_text is not None:
        (tmp / "config.toml").write_text(config_text, encoding="utf-8")


def _drop_tied_repeats(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per tied parameter (e.g. ``lm_head.weight`` tied to the embeddings).

    A gathered full state dict holds separate copies under each name of a tied parameter, so the
    tie can no longer be seen from storage sharing and ``save_pretrained`` would write both. The
    first name in module order is kept, as a single-process ``save_pretrained`` does.
    """
    first_name: dict[int, str] = {}
    repeats = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            repeats.add(name)
        else:
            first_name[id(param)] = name
    return {k: v for k, v in state.items() if k not in repeats}


def _unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied weights); copy the repeats."""
    seen, out = set(), {}
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    return out


# --- what a checkpoint holds: the manifest in meta.json, and its verification ----------------------

def _list_files(root: Path) -> list[str]:
    """Every file under ``root`` but meta.json, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != META)


def _file_owner(rel: str, index: int, world: int) -> int:
    """The rank that checksums a file: a DCP data file's writer (its pages are likely still in
    that rank's cache), the others round-robin."""
    match = DCP_FILE.search(rel)
    return (int(match.group(1)) if match else index) % world


def _record_files(root: Path, rels: list[str], rank: int = 0, world: int = 1) -> dict[str, dict[str, Any]]:
    """``{rel: {"bytes": size, CHECKSUM: hex}}`` of this rank's share of ``rels``."""
    return {rel: {"bytes": (root / rel).stat().st_size, CHECKSUM: file_checksum(root / rel)}
            for i, rel in enumerate(rels) if _file_owner(rel, i, world) == rank}


def read_meta(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(meta, None)``, or ``(None, problem)`` when meta.json is missing or unreadable."""
    meta_path = path / META
    if not meta_path.is_file():
        return None, f"{META} is missing"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{META} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
        return None, f"{META} is not a checkpoint's meta data"
    return meta, None


def _check_file(path: Path, rel: str, expected: dict[str, Any], checksums: bool) -> str | None:
    """The problem with one recorded file, or None."""
    file = path / rel
    if not file.is_file():
        return f"{rel} is missing"
    size = file.stat().st_size
    if size != expected.get("bytes"):
        return f"{rel} has {size} bytes, {expected.get('bytes')} recorded (truncated or overwritten)"
    if checksums and CHECKSUM in expected and file_checksum(file) != expected[CHECKSUM]:
        return f"{rel} does not match its recorded {CHECKSUM} checksum (its bytes changed)"
    return None


def verify_checkpoint(path: str | Path, rank: int = 0, world: int = 1, prefix: str = "",
                      checksums: bool = True) -> list[str]:
    """Check a checkpoint's files against its meta.json.

    Args:
        path: a step_XXXXXX directory.
        rank, world: check only this rank's share of the files (all of them by default).
        prefix: check only the files under this relative path (e.g. ``"hf_model/"``).
        checksums: also read every file and compare its checksum (else sizes only: no reading).

    Returns:
        The problems found, each naming its file (empty: intact). A checkpoint saved before
        checksums were recorded (no file list in its meta.json) has none to find.
    """
    path = Path(path)
    meta, problem = read_meta(path)
    if problem is not None:
        return [problem] if rank == 0 else []
    recorded = sorted((rel, entry) for rel, entry in meta.get("files", {}).items() if rel.startswith(prefix))
    return [problem for i, (rel, entry) in enumerate(recorded)
            if _file_owner(rel, i, world) == rank and (problem := _check_file(path, rel, entry, checksums))]


# --- disk: what a checkpoint takes, and whether the run's fit ---------------------------------------

@dataclass(frozen=True)
class CheckpointFootprint:
    """Bytes on disk of a run's checkpoints.

    Attributes:
        train_state: one checkpoint's train_state/ (fp32 weights and AdamW's two fp32 moments; under
            LoRA the adapters' only).
        hf_export: one HF export (the weights in the model's dtype, and under LoRA the adapter
            beside them; 0 when not exported).
        lora: the trained weights are LoRA adapters.
        peak: the most the checkpoint folder holds at once: ``keep_last`` checkpoints plus the one
            being written, with the HF exports they carry.
    """

    train_state: int
    hf_export: int
    peak: int
    lora: bool = False

    def describe(self, cfg: CheckpointConfig, export_dtype: str) -> str:
        """One line: each checkpoint's training state, the HF export and the peak with keep_last."""
        exports = ("none (checkpoint.export_hf = false)" if not self.hf_export else
                   f"{format_bytes(self.hf_export)} ({export_dtype}) " +
                   (f"every {cfg.hf_export_every} steps and at the end" if cfg.hf_export_every else "at the end"))
        weights = "the LoRA adapters' fp32 weights" if self.lora else "fp32 weights"
        return (f"{format_bytes(self.train_state)} of training state per checkpoint ({weights} "
                f"+ AdamW moments); HF export {exports}; up to {format_bytes(self.peak)} with keep_last "
                f"{cfg.keep_last} (+ the one being written)")


def checkpoint_footprint(params: int, export_dtype_bytes: int, cfg: CheckpointConfig,
                         trainable: int | None = None) -> CheckpointFootprint:
    """The disk the checkpoints of a model with ``params`` parameters take.

    Args:
        params: parameter count (tied weights once).
        export_dtype_bytes: bytes per element of the HF export (the model's dtype).
        cfg: the checkpoint section (keep_last, export_hf, hf_export_every).
        trainable: the parameters that train when fewer than ``params`` (LoRA adapters: the
            training state holds them alone, and the export adds them as the adapter folder).
    """
    lora = trainable is not None and trainable < params
    trained = trainable if lora else params
    train_state = 4 * trained * (1 + OPTIMIZER_STATE_FACTOR)
    hf_export = export_dtype_bytes * (params + (trained if lora else 0)) if cfg.export_hf else 0
    kept = cfg.keep_last + 1  # the one being written exists beside the kept ones until the prune
    exports = 0 if not cfg.export_hf else (kept if cfg.hf_export_every else 1)
    return CheckpointFootprint(train_state, hf_export, kept * train_state + exports * hf_export, lora)


def space_problem(root: str | Path, footprint: CheckpointFootprint) -> str | None:
    """Why the checkpoints would not fit in ``root``'s filesystem (None when they do): the
    checkpoints already there are counted as room, since pruning replaces them."""
    root = Path(root)
    existing = sum(tree_bytes(p) for p in root.iterdir() if STEP_DIR.match(p.name)) if root.is_dir() else 0
    free = free_bytes(root)
    if footprint.peak <= free + existing:
        return None
    return (f"the checkpoints need up to {format_bytes(footprint.peak)} in {root}, and it has "
            f"{format_bytes(free)} free" + (f" (+ {format_bytes(existing)} of checkpoints already there)"
                                            if existing else "")
            + "; free space, lower checkpoint.keep_last, or put checkpoint.dir on a larger disk")


def _state_bytes(obj: Any) -> int:
    """Bytes of the tensors and byte strings in a (nested) state dict; a DTensor counts whole."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


# --- listing --------------------------------------------------------------------------------------

def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Return (step, path) of the complete checkpoints (with meta.json) in ``root``, oldest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = STEP_DIR.match(path.name)
        if match and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_latest(root: Path) -> Path | None:
    """Return the checkpoint ``root/latest`` names; if missing or stale, the newest complete one."""
    marker = root / LATEST
    if marker.is_file():
        path = root / marker.read_text(encoding="utf-8").strip()
        if STEP_DIR.match(path.name) and (path / META).is_file():
            return path
    complete = list_checkpoints(root)
    return complete[-1][1] if complete else None


def resume_candidates(root: Path) -> list[Path]:
    """Every step_XXXXXX directory in ``root`` (complete or not), the one ``latest`` names first,
    then by step, newest first."""
    steps = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
                    if (m := STEP_DIR.match(p.name)) and p.is_dir()), reverse=True)
    ordered = [p for _, p in steps]
    marker = root / LATEST
    named = root / marker.read_text(encoding="utf-8").strip() if marker.is_file() else None
    if named in ordered:
        ordered.remove(named)
        ordered.insert(0, named)
    return ordered


# --- manager --------------------------------------------------------------------------------------

class CheckpointManager:
    """Save, verify, list, prune and restore checkpoints in one directory.

    Every rank constructs it and calls ``save``/``load``/``resume`` (they are collective under a
    process group); directory bookkeeping (rename, ``latest``, pruning, cleanup) happens on rank 0 only.
    """

    def __init__(self, root: str | Path, keep_last: int = 3):
        """
        Args:
            root: the checkpoint directory (created if missing).
            keep_last: how many checkpoints to keep (>= 1).
        """
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root, self.keep_last = Path(root), keep_last
        self.damaged: set[Path] = set()  # found damaged by a resume: not counted as kept
        self._needed_bytes = 0  # the estimated size of the checkpoint being written
        if distributed.rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self.cleanup_tmp()
        distributed.barrier()

    # -- listing --

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (with meta.json), oldest step first."""
        return list_checkpoints(self.root)

    def latest_path(self) -> Path | None:
        """The checkpoint ``latest`` names; if the marker is missing or stale, the newest complete one."""
        return find_latest(self.root)

    def cleanup_tmp(self) -> list[Path]:
        """Delete leftovers of interrupted saves (``*.tmp-*``); return what was removed."""
        removed = []
        for path in self.root.iterdir():
            if TMP_TAG in path.name:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(path)
        return removed

    # -- saving --

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        tokenizer: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        extra_state: dict[str, Any] | None = None,
        config_text: str | None = None,
        export_hf: bool = True,
        hf_dtype: torch.dtype | None = None,
    ) -> Path:
        """Write a checkpoint atomically, point ``latest`` at it and prune old ones.

        Args:
            step: the training step (names the directory).
            model: the model (plain or FSDP2-sharded).
            tokenizer: saved into hf_model/ with ``save_pretrained`` if given.
            optimizer: its state is saved FQN-keyed (shard-wise under FSDP2); left out while it has
                no state (before its first step), so saving never changes it.
            scheduler: anything with ``state_dict``/``load_state_dict`` (an LR scheduler).
            extra_state: picklable dict restored as ``LoadedCheckpoint.extra_state`` (sampler state,
                metrics, ...); rank 0's copy is kept.
            config_text: the resolved config (TOML) saved as config.toml.
            export_hf: also write hf_model/ for ``from_pretrained``.
            hf_dtype: the dtype of hf_model/'s floating tensors (the model's own, :func:`model_dtype`);
                None keeps the training dtype.

        Returns:
            The final checkpoint directory.

        Raises:
            CheckpointSaveError: the checkpoint could not be written (a full disk, an I/O error);
                nothing of it is left and the earlier checkpoints are untouched.
        """
        tmp = self.root / distributed.broadcast_object(f"step_{step:06d}{TMP_TAG}{uuid.uuid4().hex}")
        try:
            self._write(tmp, step, model, tokenizer, optimizer, scheduler, extra_state, config_text, export_hf,
                        hf_dtype)
            self._on_rank0(lambda: self._publish(tmp, step))
        except (KeyboardInterrupt, SystemExit):
            if distributed.rank() == 0:  # a real crash leaves tmp behind; the next manager cleans it
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            message = distributed.broadcast_object(self._save_failure(exc, step, tmp)
                                                   if distributed.rank() == 0 else None)
            if message is None:
                raise
            raise CheckpointSaveError(message) from exc
        return self.step_dir(step)

    def _on_rank0(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on rank 0 only; if it fails, every rank raises (rank 0 the error itself), so a
        failure there never leaves the other ranks waiting. A collective under a process group."""
        if not distributed.is_initialized():
            fn()
            return
        failure = None
        if distributed.rank() == 0:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
                failure = exc
        said = distributed.broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if said is not None:
            raise _Rank0Failed(f"rank 0 failed while saving: {said}")

    def _write(self, tmp: Path, step: int, model, tokenizer, optimizer, scheduler, extra_state,
               config_text, export_hf, hf_dtype) -> None:
        """Fill the temporary directory (collective); meta.json, listing every other file with its
        size and checksum, is written last."""
        self._on_rank0(lambda: tmp.mkdir(parents=True))
        # An optimizer that never stepped has no state; fetching its state dict would run torch's
        # zero-gradient init step, advancing its step count, so it is left out (load then skips it).
        state = self._state_template(model, optimizer if optimizer is not None and optimizer.state else None)
        state["trainer_state"] = _to_bytes({
            "format_version": FORMAT_VERSION, "step": step, "extra": extra_state or {},
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        })
        state[f"rng/rank_{distributed.rank()}"] = _to_bytes(capture_rng_state())
        params = sum(p.numel() for p in model.parameters())
        self._needed_bytes = (_state_bytes(state) + len(config_text or "")
                              + (params * (hf_dtype or torch.float32).itemsize if export_hf else 0))
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=tmp / "train_state")
        fault_point("checkpoint_write", step)
        full_state = _full_model_state(model) if export_hf else None

        self._on_rank0(lambda: _write_rank0_files(tmp, model, tokenizer, full_state, hf_dtype, config_text))
        full_state = None  # the gathered model (59 GB in fp32 for 14B parameters) is not needed any more
        rels = distributed.broadcast_object(_list_files(tmp) if distributed.rank() == 0 else None)
        files: dict[str, Any] = {}
        for part in distributed.all_gather_objects(
                _record_files(tmp, rels, distributed.rank(), distributed.world_size())):
            files.update(part)
        meta = {"step": step, "time": time.time(), "world_size": distributed.world_size(),
                "format_version": FORMAT_VERSION, "checksum": CHECKSUM, "files": dict(sorted(files.items()))}
        self._on_rank0(lambda: (tmp / META).write_text(json.dumps(meta, indent=1), encoding="utf-8"))

    def _publish(self, tmp: Path, step: int) -> None:
        """Rank 0: fsync, rename into place, update ``latest``, prune."""
        fsync_tree(tmp)
        final = self.step_dir(step)
        if final.exists():  # a re-save of this step (e.g. after resuming from an earlier one)
            trash = final.with_name(f"{final.name}{TMP_TAG}old-{uuid.uuid4().hex}")
            final.rename(trash)
            tmp.rename(final)
            shutil.rmtree(trash)
        else:
            tmp.rename(final)
        self.damaged.discard(final)
        fsync_dir(self.root)
        write_text_atomic(self.root / LATEST, final.name + "\n")
        self.prune()

    def _save_failure(self, exc: BaseException, step: int, tmp: Path) -> str | None:
        """Rank 0, after a failed save: remove the temporary directory and say what happened, or
        None when the failure is not the storage's (a bug: raised as it is)."""
        free_at_failure, partial = free_bytes(self.root), tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        needed = self._needed_bytes
        full = out_of_space(exc, free_at_failure, needed - partial)
        if not full and not storage_error(exc):
            return None
        fallback = self.latest_path()
        if fallback in self.damaged:
            fallback = next((p for _, p in reversed(self.checkpoints()) if p not in self.damaged), None)
        resume = (f"a resume will use {fallback}" if fallback is not None
                  else "there is no earlier checkpoint: a resume starts from the beginning")
        if full:
            free = free_bytes(self.root)
            return (f"the checkpoint of step {step} was not saved: the disk is full (it needs about "
                    f"{format_bytes(needed)} = {needed} bytes; {format_bytes(free)} = {free} bytes are free in "
                    f"{self.root}); the partial checkpoint was removed and {resume}. Free space, lower "
                    "checkpoint.keep_last or move checkpoint.dir (checkpoint.on_save_error = 'warn' trains on "
                    "and tries again at the next checkpoint)")
        return (f"the checkpoint of step {step} was not saved ({type(exc).__name__}: {exc}); the partial "
                f"checkpoint was removed and {resume}")

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoints, never the one ``latest`` names;
        checkpoints found damaged are neither counted nor deleted (a re-save of their step replaces them)."""
        keep = self.latest_path()
        usable = [(step, path) for step, path in self.checkpoints() if path not in self.damaged]
        removed = []
        for _, path in usable[:-self.keep_last]:
            if path != keep:
                shutil.rmtree(path)
                removed.append(path)
        return removed

    # -- verifying --

    def verify(self, path: str | Path, prefix: str = "") -> list[str]:
        """The problems of a checkpoint's files (empty: intact); see :func:`verify_checkpoint`.
        Collective: each rank checks a share of the files."""
        mine = verify_checkpoint(path, distributed.rank(), distributed.world_size(), prefix)
        return sorted(p for part in distributed.all_gather_objects(mine) for p in part)

    def _newest_intact(self, root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest intact checkpoint in ``root`` (``latest``'s first) and the damaged ones
        passed over, each with its first problem; they are remembered in ``damaged``."""
        skipped = []
        for path in resume_candidates(root):
            problems = self.verify(path)
            if not problems:
                return path, skipped
            skipped.append((path, problems[0]))
            self.damaged.add(path)
        return None, skipped

    # -- loading --

    @staticmethod
    def _state_template(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Model (and optimizer) state dicts to save from or load into: the parameters that train
        (all of them, or a LoRA adapter's: frozen base weights are the model's own files, not
        training state) and the buffers."""
        # ignore_frozen_params misses a tied name of a frozen parameter (lm_head.weight tied to the
        # frozen embedding is kept): every name of a frozen parameter is dropped here.
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        model_state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        state: dict[str, Any] = {"model": {k: v for k, v in model_state.items() if k not in frozen}}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        return state

    def load(
        self,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        restore_rng: bool = True,
    ) -> LoadedCheckpoint:
        """Restore a checkpoint into the given objects (collective under a process group). It is
        not verified here: :meth:`resume` verifies before it loads.

        Args:
            path: a step_XXXXXX directory.
            model: receives the weights.
            optimizer: receives the optimizer state (skipped if None, or if it had not stepped when saved).
            scheduler: receives the scheduler state (skipped if None).
            restore_rng: restore this rank's python/numpy/torch RNG states.

        Returns:
            Step, extra state and config text.
        """
        path = Path(path)
        if not (path / META).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        saved = dcp.FileSystemReader(str(path / "train_state")).read_metadata().state_dict_metadata
        if not any(key.startswith("optimizer.") for key in saved):
            optimizer = None  # saved before the optimizer's first step: nothing to restore
        state = self._state_template(model, optimizer)
        state["trainer_state"] = b""
        rng_key = self._rng_key(path, saved)
        state[rng_key] = b""
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path / "train_state")
        frozen = any(not p.requires_grad for p in model.parameters())  # their values come from the model's files
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not frozen))
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        trainer = _from_bytes(state["trainer_state"])
        if scheduler is not None and trainer["scheduler"] is not None:
            scheduler.load_state_dict(trainer["scheduler"])
        if restore_rng:
            restore_rng_state(_from_bytes(state[rng_key]))
        config = path / "config.toml"
        return LoadedCheckpoint(path, trainer["step"], trainer["extra"],
                                config.read_text(encoding="utf-8") if config.is_file() else None)

    @staticmethod
    def _rng_key(path: Path, saved_keys: Any) -> str:
        """This rank's RNG entry; rank 0's when the run had fewer ranks (a warned approximation)."""
        key = f"rng/rank_{distributed.rank()}"
        if key in saved_keys:
            return key
        warnings.warn(f"{path} has no RNG state for rank {distributed.rank()} (saved with fewer ranks); using rank 0's")
        return "rng/rank_0"

    def load_latest(self, model, optimizer=None, scheduler=None, restore_rng: bool = True) -> LoadedCheckpoint | None:
        """Load the checkpoint ``latest`` names, unverified; None if there is none. Args as in ``load``."""
        path = self.latest_path()
        return None if path is None else self.load(path, model, optimizer, scheduler, restore_rng)

    def resume(self, resume: str, model, optimizer=None, scheduler=None) -> LoadedCheckpoint | None:
        """Apply ``CheckpointConfig.resume``, verifying the checkpoint before it loads.

        Args:
            resume: "auto" (the newest intact checkpoint in this directory, if any), "never", or a
                path: a step_XXXXXX directory, or a checkpoint directory whose newest intact one is used.
            model, optimizer, scheduler: as in ``load``.

        Returns:
            The loaded checkpoint (its ``skipped``: the damaged ones passed over), or None when
            starting fresh.

        Raises:
            CheckpointDamaged: checkpoints exist but none is intact, or the step directory named is damaged.
            FileNotFoundError: a path with no checkpoint.
        """
        if resume == "never":
            return None
        root = self.root if resume == "auto" else Path(resume)
        if resume != "auto" and not root.is_dir():
            raise FileNotFoundError(f"resume={resume!r}: no such checkpoint or checkpoint directory")
        if resume != "auto" and (STEP_DIR.match(root.name) or (root / META).is_file()):
            problems = self.verify(root)
            if problems:
                newest, _ = self._newest_intact(root.parent)
                other = f"the newest intact one there is {newest}" if newest else "none there is intact"
                raise CheckpointDamaged(f"checkpoint.resume={resume!r} is damaged: {problems[0]}"
                                        + (f" (+ {len(problems) - 1} more)" if len(problems) > 1 else "")
                                        + f"; {other}: {RESUME_CHOICES}")
            return self.load(root, model, optimizer, scheduler)
        path, skipped = self._newest_intact(root)
        if path is None and skipped:
            damaged = "; ".join(f"{p.name}: {problem}" for p, problem in skipped)
            raise CheckpointDamaged(f"no intact checkpoint to resume from in {root} ({damaged}): {RESUME_CHOICES}")
        if path is None:
            if resume != "auto":
                raise FileNotFoundError(f"resume={resume!r}: no complete checkpoint there")
            return None
        loaded = self.load(path, model, optimizer, scheduler)
        loaded.skipped = skipped
        return loaded
