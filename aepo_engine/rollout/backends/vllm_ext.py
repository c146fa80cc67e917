"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) for weight pushes.

Kept apart from ``vllm.py`` because vLLM imports it by dotted name inside its worker processes,
which must not pay for (or recurse into) the backend module.

A push is ``aepo_begin_weight_update``, any number of ``aepo_load_weight_bucket`` calls (each a
size-bounded bucket of HF-named tensors sent as bytes through ``LLM.collective_rpc`` to an engine
in other processes) or ``aepo_load_weight_tensors`` calls (the tensors themselves, for an engine
in the caller's process), then ``aepo_finish_weight_update``. It is vLLM's own in-place reload (what ``Worker.reload_weights``
runs: the model's ``load_weights`` maps HF names onto fused qkv_proj / gate_up_proj, and each layer
is re-processed -- e.g. vLLM-CPU's repacking -- once all its weights have arrived), cut at its
seams so that the tensors can come in buckets instead of from one iterator over a whole model.
Across processes tensors travel as raw bytes with dtype and shape (plain msgpack types, which
every engine-core transport carries; bfloat16 included).

Each RPC runs inside ``with torch.device(<the worker's device>)`` as well as vLLM's config, as
vLLM's own update RPCs do: the layer-wise reload materialises each layer on a device it recorded,
and where a vLLM version records the ambient default device (CPU outside such a block) every
layer would round-trip GPU -> CPU -> GPU on every push.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def encode_bucket(tensors: dict) -> list[tuple[str, str, list[int], bytes]]:
    """``{name: tensor}`` -> ``[(name, dtype, shape, raw bytes)]`` (CPU, contiguous copies)."""
    out = []
    for name, tensor in tensors.items():
        flat = tensor.detach().to("cpu").contiguous()
        out.append((name, str(flat.dtype).removeprefix("torch."), list(flat.shape),
                    flat.view(-1).view(torch.uint8).numpy().tobytes()))
    return out


def decode_bucket(items: list) -> Iterator[tuple[str, Any]]:
    """Inverse of :func:`encode_bucket`, one tensor at a time."""
    for name, dtype, shape, data in items:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        yield name, raw.view(getattr(torch, dtype)).reshape(shape)


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` holds the vLLM model."""

    @contextlib.contextmanager
    def _aepo_context(self) -> Iterator[None]:
        """vLLM's config and the worker's device, current for one RPC (module docstring)."""
        from vllm.config import set_current_vllm_config

        device = getattr(self, "device", None) or self.model_runner.device
        with set_current_vllm_config(self.vllm_config), torch.device(device):
            yield

    def aepo_begin_weight_update(self) -> None:
        """Put every layer into deferred (layer-wise) loading."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with self._aepo_context():
            initialize_layerwise_reload(self.model_runner.get_model())

    def aepo_load_weight_bucket(self, items: list) -> int:
        """Load one bucket sent as bytes (see :func:`encode_bucket`); returns the number of tensors."""
        with self._aepo_context():
            self.model_runner.get_model().load_weights(decode_bucket(items))
        return len(items)

    def aepo_load_weight_tensors(self, tensors: dict) -> int:
        """Load one bucket of ``{hf_name: tensor}`` handed over by reference (an engine in the
        caller's process: the tensors may live on the device; nothing is copied to the host)."""
        with self._aepo_context():
            self.model_runner.get_model().load_weights(iter(tensors.items()))
        return len(tensors)

    def aepo_finish_weight_update(self) -> None:
        """Process the layers still waiting and drop state derived from the old weights."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        with self._aepo_context():
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
