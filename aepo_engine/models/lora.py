"""Low-rank adapters (LoRA) on an HF causal LM, with PEFT, for the trainer and the rollout engines.

The adapters are injected into the HF model in place (``peft.inject_adapter_in_model``): the model
stays the HF class the rest of the engine knows (its decoder, its head, FSDP2's per-layer
sharding), each adapted linear layer becomes PEFT's ``LoraLayer`` holding ``base_layer`` and the
adapter ``default``, and every parameter outside the adapters is frozen. The trainer and an HF
rollout engine inject the same :class:`~aepo_engine.models.config.LoraConfig`, so both models
name the adapter's tensors alike (``model.layers.0.self_attn.q_proj.lora_A.default.weight``):
the weight push sends those tensors only, through the same buckets as a full model.

Formats written here:
- :func:`write_adapter`: a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_A.weight``), what
  ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` read.
- :func:`merged_state`: a full state dict with each adapted weight merged, ``W + s B A`` (s =
  alpha / r), under the base model's names: what ``from_pretrained`` reads.

Only the standard LoRA of ``nn.Linear`` layers is supported (no DoRA, no bias training, no
adapters on the embedding or the head: the fused loss reads the head's weight directly).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor, nn

from aepo_engine.models.config import LoraConfig

__all__ = ["ADAPTER_NAME", "adapter_names", "adapter_pairs", "adapter_scalings", "apply_lora", "base_name",
           "has_adapter", "initial_adapter", "is_adapter", "merged_state", "peft_config", "read_adapter",
           "write_adapter"]

ADAPTER_NAME = "default"


def is_adapter(name: str) -> bool:
    """Whether a parameter name belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base model's name of a parameter of an adapted model (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``): how it is stored in the model's own checkpoint."""
    return name.replace(".base_layer.", ".")


def peft_config(cfg: LoraConfig):
    """PEFT's ``LoraConfig`` for ours."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), use_rslora=cfg.rslora, bias="none")


def apply_lora(model: nn.Module, cfg: LoraConfig, dtype: torch.dtype | None = None) -> nn.Module:
    """Inject ``cfg``'s adapters into ``model`` in place and freeze everything else.

    Args:
        model: an HF causal LM (on any device, or on meta).
        cfg: the adapters (``enabled`` is not checked here: the caller decides).
        dtype: the adapters' dtype (None: PEFT's choice, the base layers' dtype).
    Returns:
        ``model`` (the same object), its adapters at :func:`initial_adapter`'s values (B = 0: the
        model computes what it did; the same A wherever the adapters are built, on any rank or
        engine), or on meta where the model is.
    Raises:
        ValueError: no module matches ``cfg.target_modules``.
    """
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:
        raise ValueError(f"policy.lora.target_modules={list(cfg.target_modules)} matches no linear layer of "
                         f"the model ({exc})") from None
    # PEFT casts each adapted layer's input to the adapter's dtype (fp32 master weights) before
    # lora_A; under bf16 autocast the matmul casts it back to bf16, so the math is the same, but
    # autograd keeps the fp32 copy of every adapted input for the backward: on SmolLM2 (8 rows of
    # 820 tokens, micro-batches of 4) the update's peak RSS was 5.75 GiB with it, 5.00 and 5.45
    # without (two runs; the loss identical; docs/lora.md "Measured").
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False
    initial = initial_adapter(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_(is_adapter(name))
            if is_adapter(name):
                if dtype is not None:
                    param.data = param.data.to(dtype)
                if param.device.type != "meta":
                    param.copy_(initial[name])
    return model


def adapter_names(model: nn.Module) -> list[str]:
    """The adapter's parameter names, in module order."""
    return [name for name, _ in model.named_parameters() if is_adapter(name)]


def initial_adapter(model: nn.Module, seed: int = 0) -> dict[str, Tensor]:
    """PEFT's initial values of every adapter tensor of ``model`` (built on meta, where they have no
    values): A ~ kaiming-uniform(a=sqrt(5)) from a generator seeded with ``seed`` (every rank
    draws the same full tensors and keeps its shard), B = 0 (the adapted model starts equal to the
    base model). fp32, on CPU."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        value = torch.zeros(tuple(param.shape))
        if ".lora_A." in name:  # nn.init.kaiming_uniform_(a=sqrt(5)) with our generator
            bound = math.sqrt(6.0 / ((1 + 5.0) * param.shape[1]))
            value.uniform_(-bound, bound, generator=generator)
        out[name] = value
    return out


def adapter_pairs(state: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The adapter tensors of ``state`` by adapted module: ``{"...q_proj": {"A": ..., "B": ...}}``
    (a module may lack one of the two: the caller checks); other names are skipped."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, value in state.items():
        for part in ("A", "B"):
            marker = f".lora_{part}."
            if marker in name:
                pairs.setdefault(name.split(marker)[0], {})[part] = value
    return pairs


def has_adapter(state: Mapping[str, Tensor]) -> bool:
    """Whether a state dict holds adapter tensors."""
    return any(is_adapter(name) for name in state)


def adapter_scalings(model: nn.Module) -> dict[str, float]:
    """Each adapted module's factor on ``B @ A`` (PEFT's ``scaling``), by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: module.scaling[ADAPTER_NAME] for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.scaling}


def merged_state(state: Mapping[str, Tensor], scaling: float | Mapping[str, float]) -> dict[str, Tensor]:
    """A full state dict of an adapted model with each adapter merged into its weight
    (``W + scaling * B @ A``, computed in float64 and stored in W's dtype) under the base model's names.

    Args:
        state: every tensor of the adapted model (base layers and adapters), full (not sharded).
        scaling: the factor: one number (``LoraConfig.scaling``) or one per module
            (:func:`adapter_scalings`).
    """
    out = {base_name(name): value for name, value in state.items() if not is_adapter(name)}
    for module, pair in adapter_pairs(state).items():
        key = f"{module}.weight"
        if key not in out or set(pair) != {"A", "B"}:
            raise ValueError(f"merged_state: {module} has adapter tensors {sorted(pair)} and "
                             f"{'a' if key in out else 'no'} base weight")
        weight = out[key]
        factor = scaling[module] if isinstance(scaling, Mapping) else float(scaling)
        delta = factor * (pair["B"].double() @ pair["A"].double())
        out[key] = (weight.double() + delta).to(weight.dtype)
    return out


def _peft_key(name: str) -> str:
    """Our adapter name -> the key PEFT saves (``base_model.model.`` prefix, no adapter name)."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def _our_key(key: str) -> str:
    """The inverse of :func:`_peft_key`."""
    name = key.removeprefix("base_model.model.")
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
    return name


def write_adapter(directory: str | os.PathLike, tensors: Mapping[str, Tensor], cfg,
                  base_model: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

    Args:
        directory: created if missing; existing files are replaced.
        tensors: the adapter's tensors under our names (full, not sharded); other names are skipped.
        cfg: its config: ours (:class:`LoraConfig`) or PEFT's (an adapted model's ``peft_config["default"]``).
        base_model: recorded as ``base_model_name_or_path``.
        dtype: the stored dtype (None: as given).
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stored = {_peft_key(n): (t.detach().to(dtype) if dtype is not None else t.detach()).contiguous().cpu()
              for n, t in tensors.items() if is_adapter(n)}
    if not stored:
        raise ValueError("write_adapter: no adapter tensors given")
    config = (peft_config(cfg) if isinstance(cfg, LoraConfig) else cfg).to_dict()
    if base_model is not None or "base_model_name_or_path" not in config:
        config["base_model_name_or_path"] = base_model
    config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
    save_file(stored, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1, default=str), encoding="utf-8")
    return out


def read_adapter(directory: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a directory written by :func:`write_adapter` (or PEFT), under our names."""
    from safetensors.torch import load_file

    return {_our_key(k): v for k, v in load_file(str(Path(directory) / "adapter_model.safetensors")).items()}
