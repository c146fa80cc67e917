"""Loading the policy's weights: the whole model (one process), or only this rank's FSDP2 shards.

A sharded run must not hold the whole fp32 model on every rank before FSDP2 cuts it: Qwen3-14B is
~59 GB of fp32 per rank, ~470 GB on one 8-rank node. :func:`build_meta_model` builds the HF model
with its parameters on the meta device (no memory) and its buffers real (rotary ``inv_freq`` and
the like are computed by the modules' constructors, as in a normal load); the worker shards it with
``fully_shard``; :func:`load_sharded_weights` then allocates each rank's shards and fills them
from the checkpoint's safetensors files.

Each rank reads what it owns, not "rank 0 reads and broadcasts": FSDP2 shards dim 0, so a rank's
shard of a tensor is one contiguous byte range of the file, read with ``pread`` (no ``mmap``, so
no file pages are charged to the process), converted into the shard in place. Nothing crosses
the network, the ranks' reads together touch each byte of the checkpoint once, and a rank's
extra memory is one shard of one tensor in the checkpoint's dtype. The price is that every rank
needs the files (a shared or node-local filesystem, which a run that loads a checkpoint has).

The safetensors format is read directly (an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then the raw data): :class:`SafetensorsCheckpoint`.
Checkpoint names must be the model's parameter names (true of HF's own checkpoints of decoder-only
causal LMs: Llama, Qwen2/3, Mistral, ...; tied weights may be stored under either name). Models
whose checkpoints need a key conversion (some multimodal and MoE architectures) get a clear error
naming the missing tensors; ``policy.sharded_load = false`` loads them the whole way.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import Tensor, nn

from aepo_engine.models.lora import base_name
from aepo_engine.training.attention import hf_attn_implementation

__all__ = ["SafetensorsCheckpoint", "build_meta_model", "check_supported_model", "load_hf_model",
           "load_sharded_weights"]

# safetensors dtype names -> torch dtypes (the ones model checkpoints use).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsCheckpoint:
    """The tensors of a model directory's ``*.safetensors`` files, readable by row range.

    Args:
        path: a model directory (``model.safetensors``, or shards listed in
            ``model.safetensors.index.json``, or any ``*.safetensors`` files in it).
    Raises:
        FileNotFoundError: no safetensors file in ``path``.
        ValueError: a file whose header is not valid safetensors.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.path / name for name in files]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors files (the sharded load reads safetensors "
                                    "checkpoints only; convert the checkpoint or set policy.sharded_load=false)")
        # name -> (file, torch dtype, shape, absolute byte offset of the data)
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}
        for file in files:
            self.entries.update(_read_header(file))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read_rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of dim 0 of tensor ``name`` in its stored dtype (a 0-d tensor: the
        whole of it), read with one ``pread`` of exactly those bytes."""
        file, dtype, shape, offset = self.entries[name]
        if not shape:
            start, stop, row_elems = 0, 1, 1
        else:
            if not 0 <= start <= stop <= shape[0]:
                raise IndexError(f"{name}: rows {start}:{stop} outside {shape[0]}")
            row_elems = 1
            for size in shape[1:]:
                row_elems *= size
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (stop - start) * row_elems * itemsize
        buffer = bytearray(count)
        with open(file, "rb", buffering=0) as f:
            view, done = memoryview(buffer), 0
            while done < count:  # pread may return fewer bytes than asked for
                got = os.preadv(f.fileno(), [view[done:]], offset + start * row_elems * itemsize + done)
                if got <= 0:
                    raise ValueError(f"{file}: truncated data for {name}")
                done += got
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if count else torch.empty(0, dtype=torch.uint8)
        values = flat.view(dtype)
        return values.reshape(()) if not shape else values.reshape(stop - start, *shape[1:])


def _read_header(file: Path) -> Iterator[tuple[str, tuple[Path, torch.dtype, tuple[int, ...], int]]]:
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"{file}: not a safetensors file ({exc})") from None
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, which this loader does not read")
        yield name, (file, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])


# --- building and checking the model ---------------------------------------------------------------

def check_supported_model(model: nn.Module) -> None:
    """Refuse models whose logits are post-processed: the worker's log-prob path reads the plain head."""
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) is not None:
            raise NotImplementedError(f"{type(model).__name__} post-processes logits ({name}); "
                                      "the worker's log-prob path does not")


def _check_attention(attn_implementation: str) -> None:
    if attn_implementation == "flash_attention_2" and not (
            torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None):
        raise RuntimeError("attn_implementation='flash_attention_2' needs CUDA and the flash-attn "
                           "package; use 'varlen' (torch's own varlen kernel) or 'sdpa'")


def load_hf_model(path: str, attn_implementation: str) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` in float32 (the master weights): the whole model in
    this process (the non-sharded runs: one process, or ``fsdp = "off"``)."""
    from transformers import AutoModelForCausalLM

    _check_attention(attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=hf_attn_implementation(attn_implementation))
    check_supported_model(model)
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep real buffers.

    ``torch.device("meta")`` would put buffers there too, and non-persistent buffers (rotary
    frequencies) are not in the checkpoint: they would have to be recomputed model by model.
    A parameter is allocated with ``torch.empty`` before it is moved, which reserves but never
    touches memory.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_meta_model(path: str, attn_implementation: str) -> nn.Module:
    """The HF causal LM of ``path`` in float32 with parameters on the meta device (no weights read).

    Returns:
        The model in eval mode, ties applied (tied parameters are one object), buffers computed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_attention(attn_implementation)
    config = AutoConfig.from_pretrained(path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=hf_attn_implementation(attn_implementation))
    check_supported_model(model)
    return model.eval()


# --- materialising the shards ------------------------------------------------------------------------

def _local_slice(param: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's part of ``param`` (a DTensor shard, or the
    whole tensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(shape), tuple(offset)
    return tuple(param.shape), (0,) * param.dim()


def load_sharded_weights(model: nn.Module, path: str, device: torch.device,
                         initial: Mapping[str, Tensor] | None = None) -> None:
    """Allocate ``model``'s parameters (meta, sharded or not) on ``device`` and fill each rank's
    part from ``path``'s safetensors files; buffers keep their values.

    Args:
        model: the HF model built by :func:`build_meta_model`, after ``fully_shard``.
        path: the model directory it was built from.
        device: where the shards live (this rank's device).
        initial: full values of parameters the checkpoint does not hold (a LoRA adapter's,
            ``models.lora.initial_adapter``); each rank copies its shard. An adapted layer's base
            weight (``q_proj.base_layer.weight``) is read under its base name (``q_proj.weight``).
    Raises:
        KeyError: a parameter none of whose names (tied parameters have several) is in the checkpoint.
        ValueError: a checkpoint tensor whose shape differs from the parameter's.
    """
    checkpoint = SafetensorsCheckpoint(path)
    initial = dict(initial or {})
    groups: dict[int, list[str]] = {}  # one list of names per parameter (tied ones have several)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    stored_name = {n: base_name(n) for aliases in groups.values() for n in aliases}
    missing = [aliases[0] for aliases in groups.values()
               if not any(stored_name[n] in checkpoint or n in initial for n in aliases)]
    if missing:
        raise KeyError(f"{path}: {len(missing)} parameters are not in the checkpoint under the model's names "
                       f"(e.g. {', '.join(missing[:3])}); the sharded load needs checkpoints named like the "
                       "model's parameters: set policy.sharded_load=false for this model")
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device=device)
    _retie(model, groups.values())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
        for aliases in groups.values():
            param = model.get_parameter(aliases[0])
            given = next((n for n in aliases if n in initial), None)
            stored = None if given is not None else next(stored_name[n] for n in aliases if stored_name[n] in checkpoint)
            full_shape = tuple(initial[given].shape) if given is not None else checkpoint.shape(stored)
            if full_shape != tuple(param.shape):
                raise ValueError(f"{path}: {given or stored} has shape {full_shape} in the "
                                 f"{'initial values' if given else 'checkpoint'}, {tuple(param.shape)} in the model")
            local = param.to_local() if hasattr(param, "to_local") else param
            shape, offset = _local_slice(param)
            if local.numel() == 0:
                continue
            start = offset[0] if shape else 0
            stop = start + (shape[0] if shape else 1)
            rows = initial[given][start:stop] if given is not None else checkpoint.read_rows(stored, start, stop)
            for dim in range(1, len(shape)):  # only dim 0 is read by range; FSDP2 shards dim 0
                rows = rows.narrow(dim, offset[dim], shape[dim])
            local.copy_(rows)  # converts the checkpoint dtype to the master dtype in place
            del rows  # before the next read: one read buffer at a time


def _retie(model: nn.Module, groups) -> None:
    """Make every name of a tied group point at one parameter again: ``to_empty`` on a plain
    module may give each owner its own new tensor (FSDP2's sharded parameters stay shared)."""
    for aliases in groups:
        first = model.get_parameter(aliases[0])
        for name in aliases[1:]:
            if model.get_parameter(name) is not first:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, first)
