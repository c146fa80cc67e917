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
- **fused-linear head** (``policy.head_backward``, "auto": ``aepo_kernels.fused_linear.default_head_backward``;
  docs/head.md): token_outer, the ``[token_chunk, V]`` logits block (``policy.fused_chunk_bytes``;
  unset: 192 MiB on CPU, at most 2 GiB on CUDA, ``aepo_kernels.fused_linear.chunk_bytes_for``), the
  fp32 ``[V, D]`` weight-gradient accumulator and the ``[T, D]`` hidden-state gradient;
  vocab_outer (:func:`vocab_outer_head_bytes`), d_W in the weight dtype, the fp32 ``[T, D]``
  hidden-state accumulator and its copy in the compute dtype, one ``[rows, vocab_chunk]`` logits
  block (dlogits written over it) and one fp32 ``[vocab_chunk, D]`` d_W block; vocab_outer_lean
  (:func:`lean_head_bytes`), d_W and d_hidden and within 64 MiB beside them on CUDA. Tree batches
  plan the order the tree loss takes, as rows do.
- **vLLM**: awake, ``backend.gpu_memory_utilization`` of the GPU (weights, KV cache, its
  activations; with ``backend.kv_cache_gib`` the weights/T + that cache); asleep (sleep mode), a
  residual the plan takes as :data:`VLLM_ASLEEP_RESIDUAL` (an assumption: not measured here);
  level 1 keeps the weights in host memory.
- **weight sync**: one bucket gathered in the engine's dtype (each shard cast before its
  all-gather): up to ``backend.weight_sync_bucket_mb`` plus the largest single tensor (a bucket
  closes after the parameter that fills it; Qwen3-14B's embedding is 1.45 GiB in bf16).
- **vLLM's KV cache** per engine (:func:`engine_kv_cache`): its share of the GPU less the weights,
  the profiling peak and the non-torch memory, in tokens (``2 x layers x kv heads x head dim``
  bytes each) and in trajectories of ``backend.max_model_len`` tokens, against the sequences it
  runs at once (``backend.max_num_seqs`` or vLLM's default, at most the engine's trajectories per
  step). Fewer trajectories than that means preemption (recomputation) whenever they grow long:
  a problem, with the knobs that fix it.
- **carried over between phases**: the live tensors (parameters, AdamW states; gradients are
  freed when the step ends) and, unless PyTorch's cache is emptied, the blocks the update left
  cached: vLLM's sleep-mode pool allocates outside PyTorch's caching allocator and cannot reuse
  them. The trainer empties the cache after the engine sleeps and before each wake-up
  (``train.free_cached_memory``), so the plan carries nothing else; ``cache_emptied=False`` plans
  the run without it (the update's peak, less its live tensors, stays held through the sync and
  the rollout).
- **overhead**: CUDA context, NCCL buffers and allocator slack, :data:`CUDA_OVERHEAD` (an
  assumption).
The phases of a step (rollout, log-probs, update, weight sync) add up the terms present in each;
the peak phase must fit in the GPU. Host memory per rank at load: the process baseline plus, with
the sharded load, one shard of the largest tensor (the parameters go to the GPU; on CPU runs they
stay in host memory).

Validated on CPU against measured peaks (``tests/test_memory_plan.py``, ``bench/bench_memory_plan.py``):
the state terms, the activations with and without checkpointing, the head and the load, on a
small and a ~0.5B Qwen3, 1 and 2 ranks. Not validated: anything CUDA-specific (the vLLM,
KV-cache and overhead terms above are read from vLLM's settings and source and assumed, not
measured; ``bench/gpu_check.py`` compares the training terms with ``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aepo_engine.layout_plan import layout_plan
from aepo_engine.native_dtype import resolve_train_dtypes
from aepo_kernels.fused_linear import (
    CUDA_CHUNK_BYTES_MAX, DEFAULT_CHUNK_BYTES, chunks_for_budget, default_head_backward, lean_workspace,
    vocab_outer_workspace,
)

GIB = 1 << 30
# nvidia-smi's memory.total of each card, MiB.
GPUS = {"h100-80gb": 81559, "h200": 143771, "a100-80gb": 81920, "a100-40gb": 40960}
CUDA_OVERHEAD = int(2.0 * GIB)  # context, NCCL buffers, allocator slack: an assumption
VLLM_ASLEEP_RESIDUAL = int(1.0 * GIB)  # what a sleeping engine keeps (CUDA graphs, allocator): assumed
VLLM_NON_TORCH = int(1.0 * GIB)  # an awake engine's memory outside torch (NCCL, cuBLAS, CUDA graphs): assumed
# vLLM's defaults for the offline LLM class (vllm/engine/arg_utils.py, get_batch_defaults, 0.32.0):
# (max_num_seqs, max_num_batched_tokens) on GPUs of >= 70 GiB other than A100s, and on the rest.
VLLM_BATCH_DEFAULTS = {"large": (1024, 16384), "other": (256, 8192)}
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

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each linear projection of a decoder layer, by module name."""
        d, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}

    def unknown_lora_targets(self, lora: Any) -> list[str]:
        """Target modules that name none of this family's projections (:meth:`projection_shapes`)."""
        return [m for m in lora.target_modules if m.split(".")[-1] not in self.projection_shapes()]

    def lora_layer_params(self, lora: Any) -> int:
        """One decoder layer's adapter parameters, r x (in + out) per adapted projection (target
        modules naming no projection, :meth:`unknown_lora_targets`, add nothing)."""
        shapes = self.projection_shapes()
        known = {m.split(".")[-1] for m in lora.target_modules} & set(shapes)
        return sum(lora.rank * sum(shapes[m]) for m in known)

    def trainable_params(self, lora: Any) -> int:
        """Parameters that train: every one, or the adapters' under an enabled ``policy.lora``."""
        return self.layers * self.lora_layer_params(lora) if lora.enabled else self.params()

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
    kv: "EngineKV | None" = None  # vLLM's KV cache per engine (None: no engine planned)
    carried: list[str] = field(default_factory=list)  # what one phase leaves to the next
    kv_knobs: list[str] = field(default_factory=list)  # what to turn when the engine would preempt

    @property
    def preempts(self) -> bool:
        """Whether the engine's KV cache holds fewer max-length trajectories than it runs at once."""
        return self.kv is not None and self.kv.trajectories < self.kv.concurrent

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
        if self.carried:
            out.append("  carried over between phases: " + "; ".join(self.carried))
        if self.kv is not None:
            out += self.kv.lines()
        out.append("  host memory per rank at load:")
        out += [f"  {gib(v)}  {k}" for k, v in self.host.items()]
        out.append("  weight sync per step:")
        out += [f"  {gib(v)}  {k}" for k, v in self.sync_bytes.items()]
        return out


@dataclass(frozen=True)
class EngineKV:
    """vLLM's KV cache of one engine (``tp`` GPUs) and the sequences it must hold at once."""

    tp: int
    cache_bytes: int  # per GPU
    token_bytes: int  # per token, the whole engine (2 x layers x kv heads x head dim x dtype)
    max_model_len: int
    concurrent: int  # sequences at once: max_num_seqs, at most the engine's trajectories per step
    max_num_seqs: int
    per_engine: int  # trajectories one engine samples per step
    profile_bytes: int  # per GPU: vLLM's profiling peak (activations, sampler), assumed formula

    @property
    def tokens(self) -> int:
        return self.cache_bytes * self.tp // self.token_bytes

    @property
    def trajectories(self) -> int:
        """Trajectories of ``max_model_len`` tokens the cache holds."""
        return self.tokens // self.max_model_len

    def lines(self) -> list[str]:
        verdict = ("no preemption" if self.trajectories >= self.concurrent else
                   "PREEMPTS (recomputes) when they grow long")
        return [f"  vLLM KV cache per engine ({self.tp} GPU{'s' if self.tp > 1 else ''}): "
                f"{self.cache_bytes / GIB:.2f} GiB per GPU after weights, profiling peak "
                f"({self.profile_bytes / GIB:.2f}) and non-torch memory",
                f"    {self.tokens:,} tokens at {self.token_bytes / 1024:.0f} KiB/token = {self.trajectories} "
                f"trajectories of max_model_len {self.max_model_len}; up to {self.concurrent} at once "
                f"(max_num_seqs {self.max_num_seqs}, {self.per_engine} trajectories per engine per step): {verdict}"]


def engine_kv_cache(cfg: Any, shape: ModelShape, world: int, gpu: int, gpu_name: str = "",
                    checkpoint_bytes: int = 2) -> EngineKV:
    """The KV cache of one vLLM engine of ``cfg`` on ``gpu`` bytes per GPU (module docstring).

    vLLM (``gpu_worker.determine_available_memory``, 0.32.0) gives the KV cache its share of the
    GPU less what its profiling run measured: the weights, the peak of a forward of
    ``max_num_batched_tokens`` tokens and of a sampler pass over ``max_num_seqs`` rows, and the
    memory outside torch. The profiling peak is estimated here: the SwiGLU MLP's gate/up output and
    activation and the attention projections per batched token (split over the tensor-parallel
    GPUs), and three fp32 ``[max_num_seqs, V]`` sampler tensors (logits, log-probs for top-k, a
    temporary). ``backend.kv_cache_gib`` replaces all of it.
    """
    backend = cfg.backend
    tp, e = backend.tensor_parallel_size, engine_dtype_bytes(cfg, checkpoint_bytes)
    large = gpu >= 70 * GIB and "a100" not in gpu_name.lower()
    default_seqs, batched = VLLM_BATCH_DEFAULTS["large" if large else "other"]
    max_seqs = backend.max_num_seqs or default_seqs
    profile = (batched * (3 * shape.intermediate + shape.q_width + 2 * shape.kv_width) * e // tp
               + batched * shape.hidden * e + 3 * min(max_seqs, batched) * shape.vocab * 4)
    if backend.kv_cache_gib is not None:
        cache = int(backend.kv_cache_gib * GIB)
    else:
        cache = max(0, int(backend.gpu_memory_utilization * gpu) - e * shape.params() // tp - profile - VLLM_NON_TORCH)
    engines = max(1, world // tp)
    per_engine = -(-cfg.train.prompts_per_step // engines) * cfg.rollout.k
    return EngineKV(tp=tp, cache_bytes=cache, token_bytes=2 * shape.layers * shape.kv_width * e,
                    max_model_len=backend.max_model_len, concurrent=min(max_seqs, per_engine), max_num_seqs=max_seqs,
                    per_engine=per_engine, profile_bytes=profile)


def engine_awake_bytes(weights_bytes: float, kv_cache_gib: float) -> float:
    """An engine's footprint on one GPU with its KV cache given in GiB (``backend.kv_cache_gib``):
    its weights' share, the cache, its activations (half of :data:`CUDA_OVERHEAD`, assumed)."""
    return weights_bytes + kv_cache_gib * GIB + CUDA_OVERHEAD / 2


def kv_budget_utilization(weights_bytes: float, kv_cache_gib: float, gpu_total: int) -> float:
    """The ``gpu_memory_utilization`` to start vLLM with when ``backend.kv_cache_gib`` sizes its
    cache: vLLM still requires ``gpu_memory_utilization`` of the GPU free at start-up whatever
    the cache's size, so the share the plan gives the engine (:func:`engine_awake_bytes`) is
    what it is told, and the plan and the engine agree (a default 0.5 asked for 40 GiB free on an
    80 GiB GPU where the plan had room for less)."""
    return min(1.0, engine_awake_bytes(weights_bytes, kv_cache_gib) / gpu_total)


def engine_dtype_bytes(cfg: Any, checkpoint_bytes: int = 2) -> int:
    """Bytes per element of the rollout engine's weights (``backend.dtype``; "auto": the checkpoint's)."""
    return checkpoint_bytes if cfg.backend.dtype == "auto" else DTYPE_BYTES[cfg.backend.dtype]


def logprob_block_bytes(vocab: int, tokens: int, budget: int, c: int) -> int:
    """What the fused log-prob pass (``fused_linear_logprob_entropy``) holds for its logits: the
    ``[rows, vocab_chunk]`` block in the compute dtype and one temporary of its size, with the rows
    ``fused_linear.chunks_for_budget`` cuts from ``budget`` (at most ``tokens``). Measured on CPU
    (``tests/test_memory_plan.py``); the former "half the budget" held 1 GiB for 2 GiB CUDA blocks
    where the pass makes ~0.5 GiB."""
    rows, vocab_chunk = chunks_for_budget(vocab, budget)
    return 2 * min(rows, tokens) * vocab_chunk * c


def vocab_outer_head_bytes(vocab: int, dim: int, tokens: int, c: int, budget: int | None = None,
                           cuda: bool = True) -> int:
    """What the vocabulary-outer head (``head_backward = "vocab_outer"``, docs/head.md) holds at its
    peak, in its gradient pass: d_W in the weight dtype (``c`` bytes; the compute dtype's, as FSDP
    gathers it) and d_hidden, and its workspace (``fused_linear.vocab_outer_workspace``): the fp32
    ``[T, D]`` d_hidden accumulator (none when the compute dtype is fp32), the one reused ``[rows,
    vocab_chunk]`` logits block in the compute dtype (its dlogits are written over it;
    ``fused_linear.vocab_outer_chunks`` of ``budget``, unset: ``VOCAB_OUTER_BLOCK_BYTES``), the fp32
    ``[vocab_chunk, D]`` d_W block and, off CUDA in a low-precision run, the product added into it
    (``fused_linear.addmm_accumulate`` rounds it to the compute dtype) and its fp32 conversion for
    the addition (CUDA's fp32-output GEMM makes neither). Measured on CPU within 1% (fp32, bf16:
    tests/test_kernels_vocab_outer.py)."""
    return vocab * dim * c + tokens * dim * c + vocab_outer_workspace(tokens, vocab, dim, c, budget, cuda)


def lean_head_bytes(vocab: int, dim: int, tokens: int, c: int, budget: int | None = None, cuda: bool = True) -> int:
    """What ``head_backward = "vocab_outer_lean"`` (docs/head.md) holds at its peak: d_W in the
    weight dtype and d_hidden, and its workspace (``fused_linear.lean_workspace``, blocks cut from
    ``budget``, unset: ``HEAD_WORKSPACE_BYTES``, 64 MiB): the logits block and the larger of a
    token chunk's fp32 ``[rows, D]`` d_hidden block and the fp32 ``[vocab_chunk, D]`` d_W block,
    each with what ``addmm_accumulate`` adds off CUDA. Within 64 MiB of d_W + d_hidden on CUDA.
    Measured on CPU (fp32, bf16: tests/test_kernels_head_lean.py)."""
    return vocab * dim * c + tokens * dim * c + lean_workspace(tokens, vocab, dim, c, budget, cuda)


# The head term of each vocabulary-outer order: its name in the plan and its bytes.
VOCAB_OUTER_HEADS = {
    "vocab_outer": ("fused-linear head, vocabulary-outer (d_W in the weight dtype, fp32 d_hidden accumulator + "
                    "d_hidden, one vocabulary block)", vocab_outer_head_bytes),
    "vocab_outer_lean": ("fused-linear head, vocabulary-outer lean (d_W in the weight dtype, d_hidden, one fp32 "
                         "d_W block or a token chunk's fp32 d_hidden block, one logits block)", lean_head_bytes),
}


def micro_batch_tokens(cfg: Any) -> int:
    """Positions of the largest micro-batch, as the batch layout counts them
    (:meth:`aepo_engine.layout_plan.RowLayoutPlan.planned_positions`: rows' tokens or tree nodes)."""
    return layout_plan(cfg.policy).planned_positions(cfg.policy, cfg.data.max_prompt_tokens,
                                                     cfg.rollout.max_response_tokens, cfg.rollout.k)


def plan_memory(cfg: Any, shape: ModelShape, world: int, gpu: int = 0, cuda: bool = True,
                checkpoint_bytes: int = 2, gpu_name: str = "", cache_emptied: bool = True) -> MemoryPlan:
    """The memory plan of ``cfg`` (a resolved ``TrainConfig``) for ``shape`` on ``world`` ranks.

    Args:
        gpu: bytes of one GPU (0: compute the terms, decide nothing).
        checkpoint_bytes: bytes per element of the checkpoint's tensors (2: bf16, as published).
        cuda: plan a CUDA run (vLLM sleep resolved for CUDA, the overhead counted); False plans the
            CPU run the terms are validated on (no overhead, no engine memory).
        gpu_name: the ``--gpu`` name (vLLM's batch defaults differ on A100s).
        cache_emptied: PyTorch's cache is emptied before the engine wakes (what the trainer
            does); False plans the update's cached blocks carried into the sync and the rollout.
    """
    cfg = resolve_train_dtypes(cfg, "cuda" if cuda else "cpu")  # "bfloat16_if_native": aepo_engine.native_dtype
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
    # LoRA (policy.lora): the frozen base weights stay fp32 masters beside the adapters; gradients
    # and AdamW states are the adapters' only, and the head (frozen) gets no d_W.
    lora = policy.lora.enabled
    trainable = shape.trainable_params(policy.lora)
    adapter = shape.lora_layer_params(policy.lora) if lora else 0
    what = "adapters" if lora else "fp32"
    add("params", "params (fp32 master" + (" + LoRA adapters" if lora else "") + (", FSDP shard)" if sharded else ")"),
        4 * (p + (trainable if lora else 0)) / shards)
    add("grads", f"grads ({what}" + (", FSDP shard)" if sharded else ")"), 4 * trainable / shards)
    add("adam", f"AdamW states (2 x fp32{', adapters' if lora else ''}" + (", FSDP shard)" if sharded else ")"),
        8 * trainable / shards)
    if sharded:
        add("layers", f"unsharded layers ({policy.param_dtype}: the one computed + the one prefetched)",
            2 * (layer + adapter) * c)
        # a gradient is reduce-scattered from a copy in the reduce dtype into a shard-sized output
        scatter = c + r + (r / w if w > 1 else 0)
        add("layer_grad", f"a layer's unsharded gradient ({policy.param_dtype}, its {policy.reduce_dtype} "
            "reduce-scatter copy and output" + ("; the adapters' only" if lora else "") + ")",
            (adapter if lora else layer) * scatter)
        add("root", f"root params gathered (embeddings, lm_head, norm; {policy.param_dtype})", root * c)
        add("root_grad", "root params' unsharded gradient (none: frozen under LoRA)" if lora else
            f"root params' unsharded gradient (+ its {policy.reduce_dtype} reduce-scatter copy and output)",
            0 if lora else root * scatter)
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
    layout = layout_plan(policy)
    unit = layout.unit
    add("act_forward", f"activations at {tokens} micro-batch {unit}, end of forward ({how})", inputs if ckpt else full,
        f"{inputs / GIB:.2f} with checkpointing, {full / GIB:.2f} without")
    add("act_backward", f"activations during backward ({how}: " + ("the inputs + one layer recomputed)" if ckpt
        else "all saved)"), inputs + tokens * per_layer if ckpt else full)
    final_grad = v * d * (c if c != 4 else 0)  # d_W handed to autograd in the weight's dtype (a copy unless fp32)
    budget = policy.fused_chunk_bytes or (CUDA_CHUNK_BYTES_MAX if cuda else DEFAULT_CHUNK_BYTES)
    head_order = policy.head_backward if policy.head_backward != "auto" else default_head_backward(
        "cuda" if cuda else "cpu", tokens, v, d, c)
    if policy.use_fused_linear and lora:  # a frozen head: the kernel computes no d_W (needs_input_grad)
        rows = max(1, budget // (v * c))
        add("head", "fused-linear head (logits block, d_hidden; no d_W: the head is frozen under LoRA)",
            min(rows, tokens) * v * c + tokens * d * c)
        add("head_saved", "the head's gradient kept for backward (d_hidden)", tokens * d * c)
    elif policy.use_fused_linear and head_order in VOCAB_OUTER_HEADS:
        name, head_bytes = VOCAB_OUTER_HEADS[head_order]
        add("head", name, head_bytes(v, d, tokens, c, policy.fused_chunk_bytes, cuda))
        add("head_saved", "the head's gradients kept for backward (d_W, d_hidden)", (final_grad or 4 * v * d)
            + tokens * d * c)
    elif policy.use_fused_linear:
        rows = max(1, budget // (v * c))
        head = min(rows, tokens) * v * c + 4 * v * d + final_grad + tokens * d * c
        add("head", "fused-linear head, token-outer (logits block, fp32 d_W accumulator, d_W in the weight dtype, "
            "d_hidden)", head)
        add("head_saved", "the head's gradients kept for backward (d_W, d_hidden)", (final_grad or 4 * v * d)
            + tokens * d * c)
    else:
        add("head", "materialised logits and their gradient (use_fused_linear=false)", 2 * tokens * v * c)
        add("head_saved", "the head's gradient kept for backward (dlogits)", tokens * v * c)
    add("logprob_pass", "log-prob pass (no grad: hidden states, a logits block and one temporary of its size)",
        2 * tokens * d * c + logprob_block_bytes(v, tokens, budget, c))
    add("tree", *layout.planned_extra(policy, cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens,
                                      cfg.rollout.k, tokens, d, c))
    engine = cuda and backend.kind == "vllm"
    sleeps = engine and backend.sleeps(cuda)
    tp, e = backend.tensor_parallel_size, engine_dtype_bytes(cfg, checkpoint_bytes)
    engine_weights = e * p / tp
    if engine:
        if backend.kv_cache_gib is not None:
            awake = engine_awake_bytes(engine_weights, backend.kv_cache_gib)
            note = (f"weights / {tp} + kv_cache_gib + activations; vLLM started with gpu_memory_utilization "
                    f"{kv_budget_utilization(engine_weights, backend.kv_cache_gib, gpu):.3f}" if gpu else
                    f"weights / {tp} + kv_cache_gib + activations")
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
    bucket = backend.weight_sync_bucket_mb * (1 << 20) + shape.largest_tensor() * e * (1 + 1 / shards)
    add("bucket", "weight-sync bucket gathered in the engine's dtype (+ the largest tensor that closes it, "
        "and its cast shard)", bucket)
    add("overhead", "CUDA context, NCCL, allocator slack (assumed)", CUDA_OVERHEAD if cuda else 0)
    state = ["params", "adam", "overhead"]
    add("cache_carried", "PyTorch's cached blocks carried into the sync and the rollout", 0,
        "emptied before each engine wake-up")
    plan.phases = {
        "rollout (engine awake)": [*state, "cache_carried", "vllm_awake"],
        "log-probs (no grad)": [*state, "layers", "root", "logprob_pass", "vllm_idle"],
        "update: end of forward (the head)": [*state, "grads", "root", "act_forward", "head", "tree", "vllm_idle"],
        "update: backward through the layers": [*state, "grads", "root", "layers", "layer_grad", "act_backward",
                                                "head_saved", "vllm_idle"],
        # The head's d_W became the root's unsharded gradient (root_grad's first part: the tensor
        # autograd accumulated the embedding's gradient into) and its d_hidden went into the
        # layers: counting head_saved here as well planned one v x d weight twice (297 MiB over the
        # measured peak at Qwen3-0.6B's widths, tests/test_memory_plan.py).
        "update: end of backward (root gradients)": [*state, "grads", "root", "root_grad", "vllm_idle"],
        "weight sync": [*state, "cache_carried", "bucket", "vllm_weights"],
    }
    plan.carried = ["params and AdamW states (live)", "gradients freed at the end of each step"]
    if sleeps and not cache_emptied:  # PyTorch keeps the update's peak reserved, less what is live
        update = max(plan.phase_bytes(phase) for phase in plan.phases if phase.startswith("update"))
        held = update - sum(t[k].bytes for k in (*state, "vllm_idle"))
        add("cache_carried", "PyTorch's cached blocks carried into the sync and the rollout", held,
            "NOT emptied: the update's peak, less its live tensors")
        plan.carried.append(f"PyTorch's cache: {held / GIB:.2f} GiB (not emptied)")
    elif sleeps:
        plan.carried.append("PyTorch's cache: emptied after the engine sleeps and before each wake-up")
    if engine and cuda and gpu:  # the cache is the GPU's share less the rest: no GPU, no cache to plan
        plan.kv = engine_kv_cache(cfg, shape, w, gpu, gpu_name, checkpoint_bytes)
    if sharded and policy.sharded_load:
        plan.load_read_bytes = math.ceil(shape.largest_tensor() / w) * checkpoint_bytes
        load = HOST_BASELINE + plan.load_read_bytes + (0 if cuda else 4 * p / w)
        plan.host["sharded load: baseline + one shard of the largest tensor" + ("" if cuda else " + the shards")] = load
    else:
        plan.load_read_bytes = 4 * p
        plan.host["whole load: baseline + the fp32 model (from_pretrained on every rank)"] = HOST_BASELINE + 4 * p
    if sleeps and backend.sleep_level == 1:
        plan.host["vLLM weights offloaded while asleep (level 1)"] = engine_weights
    plan.sync_bytes[f"all-gathered per rank (shards cast to the engine's {e}-byte dtype)"] = int(e * p * (w - 1) / w)
    plan.sync_bytes["into the engine (its dtype)"] = int(engine_weights * tp)
    if engine and not backend.in_process:
        plan.sync_bytes["host copies (engine in its own processes: bytes through host memory)"] = int(2 * p)
    plan.knobs = _knobs(plan, cfg, sleeps, engine)
    plan.kv_knobs = _kv_knobs(plan, cfg)
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


def _kv_knobs(plan: MemoryPlan, cfg: Any) -> list[str]:
    """What to turn when the engine's KV cache holds fewer max-length trajectories than it runs at
    once (:attr:`MemoryPlan.preempts`)."""
    if not plan.preempts:
        return []
    backend, kv = cfg.backend, plan.kv
    out = []
    if kv.tp == 1 and plan.world > 1:
        out.append("backend.tensor_parallel_size = 2 (the weights split over 2 GPUs: more KV cache per engine)")
    if backend.kv_cache_gib is None and plan.gpu:
        room = (plan.gpu - plan.peak) / plan.gpu
        if room > 0.02:
            out.append(f"a larger backend.gpu_memory_utilization (now {backend.gpu_memory_utilization}; "
                       f"the GPU has {room:.0%} to spare at the plan's peak)")
    if kv.trajectories >= 1:
        out.append(f"backend.max_num_seqs = {kv.trajectories} (what the KV cache holds at max_model_len: the "
                   "other sequences wait for a slot instead of being preempted)")
    else:
        out.append(f"a smaller backend.max_model_len (now {backend.max_model_len})")
    return out
