"""Atomic, resumable training checkpoints.

Layout under ``root``::

    root/
      latest                   one line: the name of the newest complete checkpoint (written last)
      step_000123/
        train_state/           torch.distributed.checkpoint (DCP): model + optimizer (FQN-keyed, so
                               FSDP2-sharded modules save/load shard-wise and may reshard), scheduler,
                               step, extra state (sampler, metrics) and each rank's RNG states
        hf_model/              the model for ``from_pretrained`` (safetensors + config + tokenizer)
        config.toml            the resolved run config
        meta.json              step, time, world size (written last inside the directory)

A save writes into ``step_000123.tmp-<uuid>/``, fsyncs every file and directory, renames it to
``step_000123/`` and only then replaces ``latest`` (temp file + ``os.replace``). A crash at any point
leaves the previous checkpoint named by ``latest`` and intact; leftover ``*.tmp-*`` directories are
ignored by loading and deleted by the next manager. The newest ``keep_last`` checkpoints are kept, and
never the one ``latest`` names is deleted.

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
from typing import Any

import msgspec
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
from aepo_engine.errors import require
from aepo_engine.faults import fault_point

__all__ = [
    "CheckpointConfig", "CheckpointManager", "LoadedCheckpoint", "capture_rng_state", "find_latest", "list_checkpoints",
    "restore_rng_state",
]

# --- config ---------------------------------------------------------------------------------------
class CheckpointConfig(msgspec.Struct, kw_only=True):
    """Checkpoint saving and resuming.

    Attributes:
        dir: Directory holding step_XXXXXX/ checkpoints and the `latest` marker.
        every_n_steps: Save every N optimizer steps; 0 = only at the end of training.
        keep_last: Keep this many most recent checkpoints (the one `latest` names is never deleted).
        resume: "auto" resumes from the latest checkpoint in dir if there is one, "never" starts fresh,
            any other value is the path of a step_XXXXXX directory to resume from.
        save_at_end: Save a final checkpoint when training finishes.
        export_hf: Also write each checkpoint's model as a Hugging Face directory (safetensors, config,
            tokenizer) loadable with from_pretrained; the training state is saved either way.
    """

    dir: str = "checkpoints"
    every_n_steps: int = 50
    keep_last: int = 3
    resume: str = "auto"
    save_at_end: bool = True
    export_hf: bool = True

    def __post_init__(self) -> None:
        require(bool(self.dir.strip()), "dir must be a non-empty path")
        require(self.every_n_steps >= 0, f"every_n_steps must be >= 0 (0 = only at the end), got {self.every_n_steps}")
        require(self.keep_last >= 1,
                f"keep_last must be >= 1 because resuming needs at least one checkpoint, got {self.keep_last}")
        require(bool(self.resume.strip()), 'resume must be "auto", "never" or a checkpoint path')
        require(self.every_n_steps > 0 or self.save_at_end,
                "every_n_steps=0 and save_at_end=false would never save a checkpoint; enable one of them")


# --- layout ---------------------------------------------------------------------------------------

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
TMP_TAG = ".tmp-"
FORMAT_VERSION = 1


@dataclass
class LoadedCheckpoint:
    """What ``load`` restored besides the model/optimizer/scheduler it was given.

    Attributes:
        path: the checkpoint directory.
        step: the training step it was saved at.
        extra_state: the ``extra_state`` dict given to ``save`` (sampler state, metrics, ...).
        config_text: the saved config (TOML), or None.
    """

    path: Path
    step: int
    extra_state: dict[str, Any] = field(default_factory=dict)
    config_text: str | None = None


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


# --- filesystem helpers ---------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory (deepest first), so a rename publishes complete data."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(dirpath))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temp file and ``os.replace``."""
    tmp = path.with_name(f"{path.name}{TMP_TAG}{uuid.uuid4().hex}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    # Our own file; it holds RNG tuples, numpy arrays and user dicts, which weights_only rejects.
    return torch.load(io.BytesIO(data), weights_only=False)


# --- HF export ------------------------------------------------------------------------------------

def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (collective under FSDP2: every rank must call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _export_hf(out_dir: Path, model: torch.nn.Module, tokenizer: Any, full_state: dict) -> None:
    """Rank 0 writes the model (and tokenizer) as a ``from_pretrained`` directory."""
    out_dir.mkdir(parents=True)
    if hasattr(model, "save_pretrained"):  # from_pretrained re-ties what the config says is tied
        model.save_pretrained(out_dir, state_dict=_drop_tied_repeats(model, full_state))
    else:
        from safetensors.torch import save_file

        save_file(_unshare(full_state), str(out_dir / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


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


# --- listing --------------------------------------------------------------------------------------

def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Return (step, path) of the complete checkpoints (with meta.json) in ``root``, oldest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = STEP_DIR.match(path.name)
        if match and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_latest(root: Path) -> Path | None:
    """Return the checkpoint ``root/latest`` names; if missing or stale, the newest complete one."""
    marker = root / LATEST
    if marker.is_file():
        path = root / marker.read_text(encoding="utf-8").strip()
        if STEP_DIR.match(path.name) and (path / "meta.json").is_file():
            return path
    complete = list_checkpoints(root)
    return complete[-1][1] if complete else None


# --- manager --------------------------------------------------------------------------------------

class CheckpointManager:
    """Save, list, prune and restore checkpoints in one directory.

    Every rank constructs it and calls ``save``/``load`` (they are collective under a process group);
    directory bookkeeping (rename, ``latest``, pruning, cleanup) happens on rank 0 only.
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

        Returns:
            The final checkpoint directory.
        """
        tmp = self.root / distributed.broadcast_object(f"step_{step:06d}{TMP_TAG}{uuid.uuid4().hex}")
        try:
            self._write(tmp, step, model, tokenizer, optimizer, scheduler, extra_state, config_text, export_hf)
            final = self._publish(tmp, step) if distributed.rank() == 0 else self.step_dir(step)
        except BaseException:
            if distributed.rank() == 0:  # a real crash leaves tmp behind; the next manager cleans it
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        distributed.barrier()
        return final

    def _write(self, tmp: Path, step: int, model, tokenizer, optimizer, scheduler, extra_state,
               config_text, export_hf) -> None:
        """Fill the temporary directory (collective)."""
        if distributed.rank() == 0:
            tmp.mkdir(parents=True)
        distributed.barrier()
        # An optimizer that never stepped has no state; fetching its state dict would run torch's
        # zero-gradient init step, advancing its step count, so it is left out (load then skips it).
        state = self._state_template(model, optimizer if optimizer is not None and optimizer.state else None)
        state["trainer_state"] = _to_bytes({
            "format_version": FORMAT_VERSION, "step": step, "extra": extra_state or {},
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        })
        state[f"rng/rank_{distributed.rank()}"] = _to_bytes(capture_rng_state())
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=tmp / "train_state")
        fault_point("checkpoint_write", step)
        full_state = _full_model_state(model) if export_hf else None
        if distributed.rank() == 0:
            if export_hf:
                _export_hf(tmp / "hf_model", model, tokenizer, full_state)
            if config_text is not None:
                (tmp / "config.toml").write_text(config_text, encoding="utf-8")
            meta = {"step": step, "time": time.time(), "world_size": distributed.world_size(),
                    "format_version": FORMAT_VERSION}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        distributed.barrier()

    def _publish(self, tmp: Path, step: int) -> Path:
        """Rank 0: fsync, rename into place, update ``latest``, prune."""
        _fsync_tree(tmp)
        final = self.step_dir(step)
        if final.exists():  # a re-save of this step (e.g. after resuming from an earlier one)
            trash = final.with_name(f"{final.name}{TMP_TAG}old-{uuid.uuid4().hex}")
            final.rename(trash)
            tmp.rename(final)
            shutil.rmtree(trash)
        else:
            tmp.rename(final)
        _fsync_dir(self.root)
        _write_atomic(self.root / LATEST, final.name + "\n")
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoints, never the one ``latest`` names."""
        keep = self.latest_path()
        complete = self.checkpoints()
        removed = []
        for _, path in complete[:-self.keep_last]:
            if path != keep:
                shutil.rmtree(path)
                removed.append(path)
        return removed

    # -- loading --

    @staticmethod
    def _state_template(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Model (and optimizer) state dicts to save from or load into."""
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
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
        """Restore a checkpoint into the given objects (collective under a process group).

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
        if not (path / "meta.json").is_file():
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
        set_model_state_dict(model, state["model"])
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
        """Load the checkpoint ``latest`` names; None if there is none. Args as in ``load``."""
        path = self.latest_path()
        return None if path is None else self.load(path, model, optimizer, scheduler, restore_rng)

    def resume(self, resume: str, model, optimizer=None, scheduler=None) -> LoadedCheckpoint | None:
        """Apply ``CheckpointConfig.resume``.

        Args:
            resume: "auto" (latest in this directory, if any), "never", or a checkpoint path (a
                step_XXXXXX directory, or a checkpoint root whose latest is used).
            model, optimizer, scheduler: as in ``load``.

        Returns:
            The loaded checkpoint, or None when starting fresh.
        """
        if resume == "never":
            return None
        if resume == "auto":
            return self.load_latest(model, optimizer, scheduler)
        path = Path(resume)
        if not (path / "meta.json").is_file():
            path = find_latest(path)
            if path is None:
                raise FileNotFoundError(f"resume={resume!r}: no complete checkpoint there")
        return self.load(path, model, optimizer, scheduler)
