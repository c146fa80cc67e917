"""The contract between the rollout scheduler and a generation backend.

A backend turns token ids into sampled token ids (token-in/token-out: the scheduler never
re-tokenizes model output, so training sees exactly what was sampled), with the sampling
log-prob and the entropy of the sampling distribution at every generated position.

What a backend can do beyond that contract (cut a call short, sleep, exact entropies, prefix
reuse, LoRA pushes, an in-process tensor-parallel group) it declares in ``capabilities``
(:class:`Capabilities`), per instance: callers read those, never the backend's class
(:func:`requires` checks them). Backends are registered by name
(``aepo_engine.rollout.backends.registry``): ``hf`` (Hugging Face model; exact entropy from full
logits) and ``vllm`` (vLLM; entropy estimated from top-k logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Literal, Mapping, Protocol, Sequence

import torch

FinishReason = Literal["stop", "eos", "length", "abort"]
"""stop: a stop string; eos: an end-of-sequence token; length: ``max_new_tokens``; abort: cut short
because the caller's ``abort`` event was set (a weight update; the caller continues the segment)."""


@dataclass(frozen=True)
class GenRequest:
    """One continuation to sample.

    Args:
        prompt_ids: the whole context so far (prompt + trajectory tokens, tool results included).
        max_new_tokens: hard cap on generated tokens for this call.
        stop_strings: generation ends right after the decoded output ends with one of these
            (e.g. ``"</search>"``); the stop string's tokens are part of ``token_ids``.
        seed: per-request sampling seed; the same seed, model and context give the same tokens.
        temperature, top_p: sampling parameters.
        entropy_tokens: the leading sampled tokens whose entropy the caller reads (the segment
            head the branching rule and H_init average over); None = every token. A backend
            whose entropies cost extra per token (vLLM's top-k estimate) computes only these and
            reports NaN past them; an exact backend may report all.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    entropy_tokens: int | None = None


@dataclass
class GenOutput:
    """What one :class:`GenRequest` produced.

    ``logprobs[i]`` is log pi(token_ids[i]) under the sampling distribution (temperature
    applied); ``entropies[i]`` is the entropy of that distribution at position i (exact, or an
    estimate without ``Capabilities.exact_entropy``; NaN past the request's
    ``entropy_tokens`` where the backend did not compute it).
    """

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What one backend instance promises beyond :class:`GenerationBackend`'s contract. The
    instance's own: a backend built with prefix reuse off, LoRA on, sleep mode or a group reports
    that, not what its class could do. Every field defaults to False (the contract only).

    Attributes:
        abort: ``generate(requests, abort=event)`` takes a ``threading.Event``; once it is set,
            every request ends at its next token with finish reason ``"abort"`` and the tokens it
            has (asynchronous training cuts segments at weight updates and continues them from
            their prefix). Without it ``generate`` is only ever called without ``abort``.
        sleep: ``sleep()`` frees the engine's memory (its KV cache; its weights offloaded or
            dropped) and ``wake_up(tags)`` reallocates the parts named (``"weights"``,
            ``"kv_cache"``; None: all; a weight push after waking the weights refills dropped
            ones); ``asleep`` says whether any part sleeps, and ``generate`` needs none asleep.
        exact_entropy: ``GenOutput.entropies`` are the exact entropies of the sampling distribution;
            without it they are estimates (computed for ``entropy_tokens`` positions only).
        prefix_reuse: keys and values computed for a context are kept across calls and reused by a
            later request whose ``prompt_ids`` start with it (a growing context costs only its new
            tokens); a weight update drops them. Without it every call recomputes its whole context.
        lora: the engine carries the policy's LoRA adapters over frozen base weights: weight pushes
            carry the adapters' tensors only (names with ``.lora_A.`` / ``.lora_B.``).
        group: this instance is one rank of an in-process tensor-parallel engine group: ``leads``
            says whether this rank drives it; the leader calls ``generate`` and then, at the end of
            a phase of calls, ``end_phase()``; every other rank calls ``follow()`` instead, which
            replays the leader's calls until then. Without it there is nobody to follow.
    """

    abort: bool = False
    sleep: bool = False
    exact_entropy: bool = False
    prefix_reuse: bool = False
    lora: bool = False
    group: bool = False


def requires(backend: Any, *names: str, why: str) -> None:
    """Check that ``backend.capabilities`` has every capability in ``names``.

    Args:
        backend: a :class:`GenerationBackend`.
        names: fields of :class:`Capabilities`.
        why: what needs them (the error message ends with it).
    Raises:
        ValueError: a capability the backend lacks, or a name that is no capability.
    """
    known = [f.name for f in fields(Capabilities)]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"no backend capability {unknown}: expected some of {known}")
    missing = [name for name in names if not getattr(backend.capabilities, name)]
    if missing:
        raise ValueError(f"the {type(backend).__name__} backend lacks the {', '.join(missing)} "
                         f"capabilit{'y' if len(missing) == 1 else 'ies'} ({backend.capabilities}): {why}")


class GenerationBackend(Protocol):
    """A batched sampler. Implementations must be deterministic given the request seeds.

    ``capabilities`` says what else the instance does (:class:`Capabilities`); the methods and
    attributes a capability names (``generate``'s ``abort``, ``sleep``/``wake_up``/``asleep``,
    ``leads``/``follow``/``end_phase``) exist where it is set. ``weight_dtype``: the dtype the
    engine holds its weights in (the trainer gathers pushes in it); None: as they are sent.
    """

    tokenizer: Any
    capabilities: Capabilities

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def weight_dtype(self) -> torch.dtype | None: ...

    def generate(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        """Sample every request (batched as the backend sees fit); outputs in request order
        (with ``capabilities.abort`` also ``abort=``, see :class:`Capabilities`)."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (HF parameter names) without restarting the backend."""
        ...

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Load new weights streamed as buckets (each a subset, all of them the model), taking
        one bucket at a time from the iterator so that the caller never holds them all."""
        ...


class CapabilityAliases:
    """``entropy_is_exact`` and ``can_abort``: the older, read-only names of
    ``capabilities.exact_entropy`` and ``capabilities.abort``, for callers that still read them."""

    capabilities: Capabilities

    @property
    def entropy_is_exact(self) -> bool:
        return self.capabilities.exact_entropy

    @property
    def can_abort(self) -> bool:
        return self.capabilities.abort
