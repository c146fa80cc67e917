"""vLLM backend: the offline ``vllm.LLM`` engine, token-in/token-out, with estimated entropies.

Each :class:`GenRequest` becomes a ``TokensPrompt`` plus ``SamplingParams(seed=request seed,
stop=..., include_stop_str_in_output=True, logprobs=k)``. The engine runs with
``logprobs_mode="processed_logprobs"`` so the returned log-probs are those of the distribution the
token was sampled from (temperature and top_p applied, renormalised) — the same quantity the HF
backend reports. vLLM gives only the top-k of them per position, so ``entropies`` are estimates
(:func:`aepo_engine.rollout.entropy.topk_entropy_estimate`, default a power-law tail carrying
the exact leftover mass, always inside a proven lower/upper bound; the bounds themselves are in
``GenOutput.extra["entropy_lower"/"entropy_upper"]``). ``entropy_is_exact`` is
False.

Weight pushes (``load_weight_buckets``, ``update_weights``): HF-named tensors stream in
size-bounded buckets, in memory, through ``LLM.collective_rpc`` to every worker, which loads them
with vLLM's own layer-wise in-place reload (``vllm_ext.WeightLoaderExtension``); then the prefix
cache is reset, since cached KV blocks were computed with the old weights. No file, no whole-model
copy: the trainer gathers one bucket, the engine takes it, the next follows. The transport is
vLLM's engine-core channel (a copy through host memory); on multi-GPU a CUDA-IPC or NCCL
broadcast would avoid the host copy -- not done here.

vLLM spawns processes: scripts that build this backend need ``if __name__ == "__main__":``. On
CPU, set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) to bound the KV cache; vLLM-CPU needs head_dim 32/64.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Mapping, Sequence

import torch

from aepo_engine.rollout.backends.vllm_ext import encode_bucket
from aepo_engine.rollout.entropy import EstimateMode, topk_entropy_bounds, topk_entropy_estimate
from aepo_engine.rollout.protocol import GenOutput, GenRequest

_EXTENSION = "aepo_engine.rollout.backends.vllm_ext.WeightLoaderExtension"


@contextlib.contextmanager
def _visible_devices(devices: str | None):
    """Set ``CUDA_VISIBLE_DEVICES`` while the engine spawns its processes, then restore it."""
    if devices is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class VLLMBackend:
    """GenerationBackend over ``vllm.LLM`` (entropies estimated from top-k log-probs).

    Args:
        model_path: HF checkpoint folder (or hub name already in the local cache).
        seed: engine seed (per-request seeds come from the requests).
        max_model_len: context length of the engine (prompt + generated tokens).
        gpu_memory_utilization: fraction of GPU memory vLLM may use (ignored by vLLM-CPU).
        logprobs_topk: k log-probs per position for the entropy estimate (<= 20 by default
            vLLM limits).
        enable_prefix_caching: reuse KV blocks of shared prefixes (branches share their
            context, so this matters for AEPO).
        entropy_estimate: estimator mode, see ``topk_entropy_estimate``.
        dtype: model dtype for vLLM (``"auto"``: the checkpoint's).
        enforce_eager: skip torch.compile/graph capture (default: True on CPU, where it saves
            ~20 s of start-up for tiny models; False on GPU).
        devices: ``CUDA_VISIBLE_DEVICES`` of the engine's processes (the engine core and its
            tensor-parallel workers inherit it when they are spawned); None leaves it as is.
        **llm_kwargs: passed to ``vllm.LLM`` unchanged.
    """

    entropy_is_exact = False

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.5, logprobs_topk: int = 20,
                 enable_prefix_caching: bool = True, entropy_estimate: EstimateMode = "powerlaw",
                 dtype: str = "auto", enforce_eager: bool | None = None, devices: str | None = None,
                 **llm_kwargs: Any):
        from transformers import AutoTokenizer
        from vllm import LLM

        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available()
        with _visible_devices(devices):
            self.llm = LLM(
                model=str(model_path), seed=seed, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
                logprobs_mode="processed_logprobs", max_logprobs=max(logprobs_topk, 20), dtype=dtype,
                enforce_eager=enforce_eager, worker_extension_cls=_EXTENSION, **llm_kwargs,
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len = max_model_len
        self.logprobs_topk = logprobs_topk
        self.entropy_estimate = entropy_estimate
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        eos: set[int] = set()
        for src in (self.llm.llm_engine.model_config.try_get_generation_config().get("eos_token_id"),
                    self.tokenizer.eos_token_id):
            eos.update([] if src is None else [src] if isinstance(src, int) else src)
        self._eos = tuple(sorted(eos))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def prefix_caching_enabled(self) -> bool:
        return bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """Cumulative prefix-cache token queries/hits, or None unless built with
        ``disable_log_stats=False`` (vLLM collects no metrics otherwise)."""
        try:
            metrics = {m.name: m for m in self.llm.get_metrics()}
        except Exception:  # noqa: BLE001 - metrics are optional across vLLM builds
            return None
        if "vllm:prefix_cache_queries" not in metrics:
            return None
        return {"queries": int(metrics["vllm:prefix_cache_queries"].value),
                "hits": int(metrics["vllm:prefix_cache_hits"].value)}

    # -----------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        """Sample every request in one ``LLM.generate`` call; outputs in request order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params, slots = [], [], []
        outputs: list[GenOutput | None] = [None] * len(requests)
        for i, req in enumerate(requests):
            budget = min(req.max_new_tokens, self.max_model_len - len(req.prompt_ids))
            if budget <= 0:  # nothing to sample: the context already fills the window
                outputs[i] = GenOutput([], [], [], "length")
                continue
            prompts.append(TokensPrompt(prompt_token_ids=list(req.prompt_ids)))
            params.append(SamplingParams(
                n=1, max_tokens=budget, temperature=req.temperature, top_p=req.top_p,
                seed=int(req.seed), stop=list(req.stop_strings) or None,
                include_stop_str_in_output=True, logprobs=self.logprobs_topk,
                skip_special_tokens=True,
            ))
            slots.append(i)
        if prompts:
            results = self.llm.generate(prompts, params, use_tqdm=False)
            for i, result in zip(slots, results):
                outputs[i] = self._convert(result.outputs[0])
        return outputs  # type: ignore[return-value]

    def _convert(self, completion) -> GenOutput:
        tokens = list(completion.token_ids)
        sampled_lp, topk = [], []
        for token, position in zip(tokens, completion.logprobs):
            sampled_lp.append(float(position[token].logprob))
            # vLLM returns the top-k plus the sampled token when it falls outside the top-k;
            # the k largest values are the top-k either way.
            values = sorted((lp.logprob for lp in position.values()), reverse=True)[: self.logprobs_topk]
            topk.append(values)
        topk_t = torch.tensor(topk, dtype=torch.float64).reshape(len(tokens), -1)  # [T, k]
        estimate = topk_entropy_estimate(topk_t, self.vocab_size, self.entropy_estimate)
        lower, upper = topk_entropy_bounds(topk_t, self.vocab_size)
        if completion.finish_reason == "length":
            reason, stop = "length", None
        elif isinstance(completion.stop_reason, str):
            reason, stop = "stop", completion.stop_reason
        else:  # EOS (stop_reason None) or a stop token id
            reason, stop = "eos", None
        return GenOutput(
            token_ids=tokens, logprobs=sampled_lp, entropies=estimate.tolist(),
            finish_reason=reason, stop_string=stop,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            extra={"entropy_lower": lower.tolist(), "entropy_upper": upper.tolist()},
        )

    # -----------------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Push HF-named weights (any subset) into the running engine, then drop cached KV."""
        self.load_weight_buckets([state_dict])

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Stream weights into the engine a bucket at a time (peak extra memory: one bucket).

        Each bucket is cast to the engine's dtype, sent in memory to every worker and loaded
        there (``vllm_ext``); a bucket is released before the next one is taken from the
        iterator, so a caller that gathers weights lazily never holds the whole model.
        """
        dtype = self.llm.llm_engine.model_config.dtype
        self.llm.collective_rpc("aepo_begin_weight_update")
        for bucket in buckets:
            items = encode_bucket({name: value.detach().to(dtype=dtype) for name, value in bucket.items()})
            self.llm.collective_rpc("aepo_load_weight_bucket", args=(items,))
            del items
        self.llm.collective_rpc("aepo_finish_weight_update")
        self.llm.reset_prefix_cache()
