"""The host-memory plan of a CPU run (one process, the HF rollout backend), printed by ``--dry-run``
on a machine without CUDA. Arithmetic from the model's ``config.json`` and the run's config, as
:mod:`aepo_engine.memory_plan` plans a GPU; its update terms (state, activations, head) are that
module's CPU terms, which it validates against measured peaks. What a CPU run adds:

- **baseline**: the interpreter with torch, transformers and the engine imported
  (:data:`CPU_BASELINE`, measured: bench/results/real_model.jsonl);
- **autocast copies**: with ``policy.param_dtype = "bfloat16"`` a bf16 copy of every weight that
  autocast keeps for the forward and backward;
- **rollout backend**: the HF backend's own copy of the weights in ``backend.dtype``, its prefix
  store (keys and values of earlier contexts, up to ``backend.kv_cache_gib``, 1 GiB by default),
  the decode cache of a batch (``backend.max_batch_size`` rows of prompt + response tokens) and the
  sampling maths (three ``[rows, V]`` float32 arrays), for the larger of a training step's rows
  and an evaluation's (``eval.num_questions`` x ``eval.samples``; all the synthetic task's
  held-out questions for 0, the training rows for a data set of unknown size);
- the prefix store is emptied by the weight sync, after the update: it is held through the update.
The peak is the larger of the rollout and the update on top of what both hold.
Left out: the search index and the python sandbox (tens of MiB), allocator fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aepo_engine.memory_plan import DTYPE_BYTES, GIB, ModelShape, plan_memory
from aepo_engine.native_dtype import resolve_train_dtypes

__all__ = ["CPU_BASELINE", "CpuMemoryPlan", "plan_cpu_memory"]

CPU_BASELINE = int(0.9 * GIB)  # torch + transformers + engine imported (measured ~0.8-0.9 GiB)
DEFAULT_PREFIX_STORE = 1.0  # GiB: the HF backend's prefix_cache_gib default


@dataclass
class CpuMemoryPlan:
    """Terms (name -> bytes) held throughout, during the rollout and during the update; the peak."""

    held: dict[str, int] = field(default_factory=dict)
    rollout: dict[str, int] = field(default_factory=dict)
    update: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.held.values()) + max(sum(self.rollout.values()), sum(self.update.values()))

    def lines(self) -> list[str]:
        out = ["CPU memory plan (one process, HF backend):"]
        for title, terms in (("held", self.held), ("rollout", self.rollout), ("update", self.update)):
            out += [f"  {title}: {name}: {value / GIB:.2f} GiB" for name, value in terms.items()]
        phase = "rollout" if sum(self.rollout.values()) >= sum(self.update.values()) else "update"
        out.append(f"  peak: {self.peak / GIB:.2f} GiB (at the {phase})")
        return out


def plan_cpu_memory(cfg: Any, shape: ModelShape) -> CpuMemoryPlan:
    """The CPU plan of ``cfg`` (a resolved ``TrainConfig``) for ``shape`` (module docstring)."""
    cfg = resolve_train_dtypes(cfg, "cpu")  # "bfloat16_if_native": this CPU's dtype (aepo_engine.native_dtype)
    policy, backend, rollout = cfg.policy, cfg.backend, cfg.rollout
    p = shape.params()
    gpu_terms = plan_memory(cfg, shape, world=1, gpu=0, cuda=False).terms
    plan = CpuMemoryPlan()
    plan.held["baseline (imports)"] = CPU_BASELINE
    # (under LoRA: the fp32 base weights and the adapters, AdamW states and gradients the adapters' only)
    plan.held["policy: fp32 weights + AdamW states"] = gpu_terms["params"].bytes + gpu_terms["adam"].bytes
    if policy.param_dtype != "float32":
        plan.held[f"autocast's {policy.param_dtype} weight copies"] = p * DTYPE_BYTES[policy.param_dtype]
    engine_bytes = 4 if backend.dtype in ("auto", "float32") else DTYPE_BYTES[backend.dtype]
    plan.held[f"rollout backend weights ({backend.dtype})"] = p * engine_bytes
    kv_per_token = shape.layers * 2 * shape.kv_width * engine_bytes
    # the rows one rollout call samples: a training step's, or an evaluation's when it has more
    # (the smollm2 preset's 150 questions peaked 2.7 GiB above a 4-question run: docs/experiments.md)
    questions = cfg.eval.num_questions or (cfg.task.synthetic.num_heldout if cfg.task.source == "synthetic" else 0)
    rows = max(rollout.k * cfg.train.prompts_per_step, questions * cfg.eval.samples)
    context = cfg.data.max_prompt_tokens + rollout.max_response_tokens
    store_cap = (backend.kv_cache_gib if backend.kv_cache_gib is not None else DEFAULT_PREFIX_STORE) * GIB
    store = 0 if not backend.enable_prefix_caching else min(store_cap, rows * context * kv_per_token)
    plan.held["prefix store (until the weight sync)"] = int(store)
    batch = min(rows, backend.max_batch_size)
    plan.rollout["decode cache (a batch's keys and values)"] = batch * context * kv_per_token
    plan.rollout["sampling maths (3 x [rows, V] float32)"] = 3 * batch * shape.vocab * 4
    update = max(gpu_terms[k].bytes for k in ("act_forward", "act_backward"))
    plan.update["gradients (fp32)"] = gpu_terms["grads"].bytes
    plan.update["activations (a micro-batch)"] = update
    plan.update["head (logits block, its gradients)"] = gpu_terms["head"].bytes + gpu_terms["head_saved"].bytes
    return plan
