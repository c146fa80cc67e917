"""A per-GPU memory plan of a resolved run, printed by ``--dry-run --gpu NAME|GiB [--world-size N]``.

Arithmetic only (no weights, no GPU): the model's shapes come from its ``config.json``, the rest
from the run's config. Per GPU (one FSDP2 rank), bytes:

- **params, grads, AdamW states**: FSDP2 shards of the fp32 master weights, their fp32 gradients
  and AdamW's two fp32 moments: ``4P/W``, ``4P/W``, ``8P/W`` (P parameters, W ranks).
- **unsharded layers**: the decoder layer being computed and the next one FSDP2 prefetches,
  gathered in the compute dtype, plus the layer's unsharded gradient before its reduce-scatter:
  ``3 x layer params x c`` (c = bytes of the compute dtype); and the root module's parameters
  (embeddings, lm_head, final norm), gathered for the whole forward and backward.
- **activations** at ``T`` micro-batch tokens (:meth:`ModelShape.saved_bytes_per_token`: what
  autograd saves per token in one HF Llama/Qwen decoder layer with a fused attention kernel);
  with activation checkpointing only each layer's input (``T x D x c`` per layer) plus one layer
  recomputed in backward; without, every layer's saved tensors.
- **rollout trees** (``policy.tree_batches``): ``T`` counts tree nodes, not row tokens (a group's
  prompt once, then each trajectory's own tokens: without a node budget, the micro-batch's groups
  times ``max prompt + k x max response``); and the loss's extra ``[T, D]`` (each node's parent's
  hidden state, gathered, and its gradient), its per-occurrence statistics (``[M]`` fp32 vectors,
  M the rows' label positions) and, on CUDA, FlexAttention's block mask (``(T / 128)^2`` int32s,
  negligible).
- **fused-linear head**: the ``[token_chunk, V]`` logits block (``policy.fused_chunk_bytes``), the
  fp32 ``[V, D]`` weight-gradient accumulator and the ``[T, D]`` hidden-state gradient.
- **vLLM**: awake, ``backend.gpu_memory_utilization`` of the GPU (weights, KV cache, its
  activations; with ``backend.kv_cache_gib`` the weights/T + that cache); asleep (sleep mode), a
  residual the plan takes as :data:`VLLM_ASLEEP_RESIDUAL` (an assumption: not measured here);
  level 1 keeps the weights in host memory.
- **weight sync**: one bucket gathered in fp32 plus its copy in the engine's dtype.
- **overhead**: CUDA context, NCCL buffers and allocator slack, :data:`CUDA_OVERHEAD` (an
  assumption).
The phases of a step (rollout, log-probs, update, weight sync) add up the terms present in each;
the peak phase must fit in the GPU. Host memory per rank at load: the process baseline plus, with
the sharded load, one shard of the largest tensor (the parameters go to the GPU; on CPU runs they
stay in host memory).

Validated on CPU against measured peaks (``tests/test_memory_plan.py``, ``bench/bench_memory_plan.py``):
the state terms, the activations with and without checkpointing, the head and the load, on a
small and a ~0.5B Qwen3, 1 and 2 ranks. Not validated: anything CUDA-specific (the vLLM and
overhead terms above are read from vLLM's settings and assumed, not measured).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
# nvidia-smi's memory.total of each card, MiB.
GPUS = {"h100-80gb": 81559, "h200": 143771, "a100-80gb": 81920, "a100-40gb": 40960}
CUDA_OVERHEAD = int(2.0 * GIB)  # context, NCCL buffers, allocator slack: an assumption
VLLM_ASLEEP_RESIDUAL = int(1.0 * GIB)  # what a sleeping engine keeps (CUDA graphs, allocator): assumed
HOST_BASELINE = int(3.0 * GIB)  # imports (torch, transformers, vLLM) per rank: an assumption on GPU hosts
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gpu_bytes(spec: str) -> int:
    """``h100-80gb`` / ``h200`` / ``a100-80gb`` / ``a100-40gb`` or a number of GiB -> bytes.

    Raises:
        ValueError: an unknown name or a non-positive number.
    """
    if spec.lower() in GPUS:
        return GPUS[spec.lower()] << 20
    try:
        value = float(spec)
    except ValueError:
        raise ValueError(f"--gpu {spec!r}: one of {', '.join(GPUS)} or a size in GiB") from None
    if not value > 0:
        raise ValueError(f"--gpu {spec!r}: the size in GiB must be > 0")
    return int(value * GIB)


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a decoder-only HF causal LM of the Llama / Qwen2 / Qwen3 family."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        """From a ``config.json`` dict.

        Raises:
            ValueError: a config without the fields of a decoder-only transformer.
        """
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(vocab=int(config["vocab_size"]), hidden=hidden, intermediate=int(config["intermediate_size"]),
                       layers=int(config["num_hidden_layers"]), heads=heads,
                       kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       tied=bool(config.get("tie_word_embeddings", False)),
                       qk_norm=config.get("model_type") == "qwen3")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a decoder-only transformer config (missing or bad {exc})") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelShape":
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        d = self.hidden
        attention = d * self.q_width + 2 * d * self.kv_width + self.q_width * d
        norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        return attention + 3 * d * self.intermediate + norms

    def root_params(self) -> int:
        """Embeddings, lm_head (unless tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def largest_tensor(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * self.q_width)

    def saved_bytes_per_token(self, c: int) -> int:
        """Bytes autograd keeps per token for one decoder layer's backward (compute dtype of ``c``
        bytes; RMSNorm computes in fp32 and keeps its fp32 input).

        Per layer and token, as the HF layer is written: two RMSNorms (fp32 input ``4D``, normed
        output ``cD``); q/k norms (Qwen3: fp32 input and output of each); rotary embedding (the
        rotated halves of q and k); attention with a fused kernel (q, k, v, its output and its
        contiguous copy for o_proj, fp32 log-sum-exp per head); the SwiGLU MLP (gate, up, the
        activation and the product: ``4 I c``).
        """
        d, q, kv = self.hidden, self.q_width, self.kv_width
        norms = 2 * (4 * d + c * d)
        qk_norms = (4 + c) * (q + kv) if self.qk_norm else 0
        rotary = c * (q + kv)
        attention = c * (q + 2 * kv) + 2 * c * q + 4 * self.heads
        mlp = 4 * c * self.intermediate
        return norms + qk_norms + rotary + attention + mlp


@dataclass
class Term:
    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """The terms and phases of one GPU's (one rank's) memory, and the host's at load."""

    gpu: int  # bytes of the GPU (0: no GPU given: terms only)
    world: int
    terms: dict[str, Term] = field(default_factory=dict)
    phases: dict[str, list[str]] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    sync_bytes: dict[str, int] = field(default_factory=dict)
    knobs: list[str] = field(default_factory=list)
    load_read_bytes: int = 0  # what a rank holds above its shards while loading (the read buffer)

    def phase_bytes(self, phase: str) -> int:
        return sum(self.terms[name].bytes for name in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.gpu == 0 or self.peak <= self.gpu

    def lines(self) -> list[str]:
        """The plan as text (GiB with two decimals)."""
        gib = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
        out = [f"memory plan per GPU ({self.world} ranks; GiB):"]
        out += [f"  {gib(t.bytes)}  {t.name}" + (f"  ({t.note})" if t.note else "") for t in self.terms.values()]
        out.append("  phases (the terms present at each one's peak):")
        for phase in self.phases:
            mark = " <- peak" if phase == self.peak_phase else ""
            out.append(f"  {gib(self.phase_bytes(phase))}  {phase}{mark}")
        if self.gpu:
            out.append(f"  {gib(self.gpu)}  GPU memory: {'fits' if self.fits else 'DOES NOT FIT'} "
                       f"(peak {self.peak / self.gpu:.0%} of it)")
        out.append("  host memory per rank at load:")
        out += [f"  {gib(v)}  {k}" for k, v in self.host.items()]
        out.append("  weight sync per step:")
        out += [f"  {gib(v)}  {k}" for k, v in self.sync_bytes.items()]
        return out


def micro_batch_tokens(cfg: Any) -> int:
    """Positions of the largest micro-batch: ``policy.micro_batch_max_tokens``, else
    ``micro_batch_size`` rows of the longest possible row (prompt + response); with tree batches
    the nodes of the micro-batch's whole groups (each prompt once)."""
    policy, prompt, response = cfg.policy, cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens
    if policy.micro_batch_max_tokens is not None:
        return policy.micro_batch_max_tokens
    if policy.trees:
        groups = max(1, policy.micro_batch_size // cfg.rollout.k)
        return groups * (prompt + cfg.rollout.k * response)
    return policy.micro_batch_size * (prompt + response)


def micro_batch_rows(cfg: Any) -> int:
    """Rows of the largest micro-batch (the tree loss's occurrences are their label positions)."""
    policy = cfg.policy
    if policy.trees:
        return max(policy.micro_batch_size // cfg.rollout.k, 1) * cfg.rollout.k
    return policy.micro_batch_size


def plan_memory(cfg: Any, shape: ModelShape, world: int, gpu: int = 0, cuda: bool = True,
                checkpoint_bytes: int = 2) -> MemoryPlan:
    """The memory plan of ``cfg`` (a resolved ``TrainConfig``) for ``shape`` on ``world`` ranks.

    Args:
        gpu: bytes of one GPU (0: compute the terms, decide nothing).
        checkpoint_bytes: bytes per element of the checkpoint's tensors (2: bf16, as published).
        cuda: plan a CUDA run (vLLM sleep resolved for CUDA, the overhead counted); False plans the
            CPU run the terms are validated on (no overhead, no engine memory).
    """
    policy, backend = cfg.policy, cfg.backend
    p, w = shape.params(), world
    c = DTYPE_BYTES[policy.param_dtype]
    sharded = policy.fsdp == "on" or (policy.fsdp == "auto" and world > 1)
    shards = w if sharded else 1
    tokens = micro_batch_tokens(cfg)
    plan = MemoryPlan(gpu=gpu, world=w)
    t = plan.terms

    def add(key: str, name: str, value: float, note: str = "") -> None:
        t[key] = Term(name, int(value), note)

    r = DTYPE_BYTES[policy.reduce_dtype]
    d, v, layer, root = shape.hidden, shape.vocab, shape.layer_params(), shape.root_params()
    add("params", "params (fp32 master" + (", FSDP shard)" if sharded else ")"), 4 * p / shards)
    add("grads", "grads (fp32" + (", FSDP shard)" if sharded else ")"), 4 * p / shards)
    add("adam", "AdamW states (2 x fp32" + (", FSDP shard)" if sharded else ")"), 8 * p / shards)
    if sharded:
        add("layers", f"unsharded layers ({policy.param_dtype}: the one computed + the one prefetched)", 2 * layer * c)
        # a gradient is reduce-scattered from a copy in the reduce dtype into a shard-sized output
        scatter = c + r + (r / w if w > 1 else 0)
        add("layer_grad", f"a layer's unsharded gradient ({policy.param_dtype}, its {policy.reduce_dtype} "
            "reduce-scatter copy and output)", layer * scatter)
        add("root", f"root params gathered (embeddings, lm_head, norm; {policy.param_dtype})", root * c)
        add("root_grad", f"root params' unsharded gradient (+ its {policy.reduce_dtype} reduce-scatter copy and "
            "output)", root * scatter)
    else:
        for key in ("layers", "layer_grad", "root", "root_grad"):
            add(key, f"{key} (none: no FSDP)", 0)
        if c != 4:  # autocast caches one low-precision copy of every weight for the forward + backward
            add("root", f"autocast's {policy.param_dtype} copies of the weights (no FSDP)", p * c)
    per_layer = shape.saved_bytes_per_token(c)
    ckpt = policy.activation_checkpointing
    inputs = shape.layers * tokens * d * c  # each layer's input, what checkpointing keeps
    full = shape.layers * tokens * per_layer
    how = "checkpointed" if ckpt else "not checkpointed"
    unit = "tree nodes" if policy.trees else "tokens"
    add("act_forward", f"activations at {tokens} micro-batch {unit}, end of forward ({how})", inputs if ckpt else full,
        f"{inputs / GIB:.2f} with checkpointing, {full / GIB:.2f} without")
    add("act_backward", f"activations during backward ({how}: " + ("the inputs + one layer recomputed)" if ckpt
        else "all saved)"), inputs + tokens * per_layer if ckpt else full)
    final_grad = v * d * (c if c != 4 else 0)  # d_W handed to autograd in the weight's dtype (a copy unless fp32)
    if policy.use_fused_linear:
        rows = max(1, policy.fused_chunk_bytes // (v * c))
        head = min(rows, tokens) * v * c + 4 * v * d + final_grad + tokens * d * c
        add("head", "fused-linear head (logits block, fp32 d_W accumulator, d_W in the weight dtype, d_hidden)", head)
        add("head_saved", "the head's gradients kept for backward (d_W, d_hidden)", (final_grad or 4 * v * d)
            + tokens * d * c)
    else:
        add("head", "materialised logits and their gradient (use_fused_linear=false)", 2 * tokens * v * c)
        add("head_saved", "the head's gradient kept for backward (dlogits)", tokens * v * c)
    add("logprob_pass", "log-prob pass (no grad: hidden states, half the fused pass's chunk budget)",
        2 * tokens * d * c + policy.fused_chunk_bytes / 2)
    if policy.trees:
        row = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
        # a node is read by at most the k rows of its group
        occurrences = micro_batch_rows(cfg) * row if policy.micro_batch_max_tokens is None else cfg.rollout.k * tokens
        add("tree", f"tree loss: parents' hidden states gathered + their gradient ({tokens} nodes), "
            "per-occurrence statistics", 2 * tokens * d * c + 12 * 4 * occurrences,
            f"{occurrences} occurrences at most")
    else:
        add("tree", "tree loss (none: tree_batches off)", 0)
    engine = cuda and backend.kind == "vllm"
    sleeps = engine and backend.sleeps(cuda)
    tp = backend.tensor_parallel_size
    engine_weights = 2 * p / tp
    if engine:
        if backend.kv_cache_gib is not None:
            awake = engine_weights + backend.kv_cache_gib * GIB + CUDA_OVERHEAD / 2
            note = f"weights / {tp} + kv_cache_gib + activations"
        else:
            awake = backend.gpu_memory_utilization * gpu if gpu else engine_weights
            note = f"gpu_memory_utilization {backend.gpu_memory_utilization} of the GPU"
        add("vllm_awake", "vLLM engine awake", awake, note)
        add("vllm_idle", "vLLM engine during the update", VLLM_ASLEEP_RESIDUAL if sleeps else awake,
            f"asleep (level {backend.sleep_level})" if sleeps else "awake: no sleep mode")
        add("vllm_weights", "vLLM weights during the sync", engine_weights if sleeps else awake)
    else:
        for key in ("vllm_awake", "vllm_idle", "vllm_weights"):
            add(key, "no engine memory (" + ("HF backend: the policy samples" if cuda else "CPU plan") + ")", 0)
    bucket = backend.weight_sync_bucket_mb * (1 << 20)
    add("bucket", "weight-sync bucket (fp32 gathered + engine-dtype copy)", bucket * 1.5)
    add("overhead", "CUDA context, NCCL, allocator slack (assumed)", CUDA_OVERHEAD if cuda else 0)
    state = ["params", "adam", "overhead"]
    plan.phases = {
        "rollout (engine awake)": [*state, "vllm_awake"],
        "log-probs (no grad)": [*state, "layers", "root", "logprob_pass", "vllm_idle"],
        "update: end of forward (the head)": [*state, "grads", "root", "act_forward", "head", "tree", "vllm_idle"],
        "update: backward through the layers": [*state, "grads", "root", "layers", "layer_grad", "act_backward",
                                                "head_saved", "vllm_idle"],
        "update: end of backward (root gradients)": [*state, "grads", "root", "root_grad", "head_saved", "vllm_idle"],
        "weight sync": [*state, "bucket", "vllm_weights"],
    }
    if sharded and policy.sharded_load:
        plan.load_read_bytes = math.ceil(shape.largest_tensor() / w) * checkpoint_bytes
        load = HOST_BASELINE + plan.load_read_bytes + (0 if cuda else 4 * p / w)
        plan.host["sharded load: baseline + one shard of the largest tensor" + ("" if cuda else " + the shards")] = load
    else:
        plan.load_read_bytes = 4 * p
        plan.host["whole load: baseline + the fp32 model (from_pretrained on every rank)"] = HOST_BASELINE + 4 * p
    if sleeps and backend.sleep_level == 1:
        plan.host["vLLM weights offloaded while asleep (level 1)"] = engine_weights
    plan.sync_bytes["all-gathered per rank (fp32 shards)"] = int(4 * p * (w - 1) / w)
    plan.sync_bytes["into the engine (its dtype)"] = int(engine_weights * tp)
    if engine and not backend.in_process:
        plan.sync_bytes["host copies (engine in its own processes: bytes through host memory)"] = int(2 * p)
    plan.knobs = _knobs(plan, cfg, sleeps, engine)
    return plan


def _knobs(plan: MemoryPlan, cfg: Any, sleeps: bool, engine: bool) -> list[str]:
    """What to turn when the plan does not fit, largest term first."""
    if plan.fits:
        return []
    policy, backend = cfg.policy, cfg.backend
    t = plan.terms
    out = []
    if not policy.activation_checkpointing:
        out.append("policy.activation_checkpointing = true")
    if max(t["act_forward"].bytes, t["act_backward"].bytes) > 0.15 * plan.gpu:
        out.append(f"a smaller policy.micro_batch_max_tokens (now {micro_batch_tokens(cfg)})")
    if engine and not sleeps:
        out.append("backend.sleep_between_steps = true")
    if engine and t["vllm_awake"].bytes > 0.3 * plan.gpu:
        out.append(f"a smaller backend.gpu_memory_utilization (now {backend.gpu_memory_utilization})")
    if t["params"].bytes + t["grads"].bytes + t["adam"].bytes > 0.4 * plan.gpu:
        out.append("more GPUs (FSDP2 shards the parameters, gradients and AdamW states over all ranks)")
    return out or ["more GPUs, or GPUs with more memory"]
