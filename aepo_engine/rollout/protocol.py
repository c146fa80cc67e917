"""The contract between the rollout scheduler and a generation backend.

A backend turns token ids into sampled token ids (token-in/token-out: the scheduler never
re-tokenizes model output, so training sees exactly what was sampled), with the sampling
log-prob and the entropy of the sampling distribution at every generated position.

Backends: ``aepo_engine.rollout.backends.hf`` (Hugging Face ``generate``; exact entropy from full
logits) and ``aepo_engine.rollout.backends.vllm`` (vLLM; entropy estimated from top-k logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
    estimate when ``GenerationBackend.entropy_is_exact`` is False; NaN past the request's
    ``entropy_tokens`` where the backend did not compute it).
    """

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class GenerationBackend(Protocol):
    """A batched sampler. Implementations must be deterministic given the request seeds.

    ``can_abort``: ``generate`` takes an ``abort`` event (``threading.Event``) and, once it is set,
    ends every request at the next token with finish reason ``"abort"`` and what it has sampled so
    far (asynchronous training cuts segments at weight updates and continues them from their
    prefix). A backend without it (no attribute, or False) is only ever called without ``abort``.
    """

    tokenizer: Any
    entropy_is_exact: bool

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def generate(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        """Sample every request (batched as the backend sees fit); outputs in request order
        (``can_abort`` backends also take ``abort=``, see above)."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (HF parameter names) without restarting the backend."""
        ...

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Load new weights streamed as buckets (each a subset, all of them the model), taking
        one bucket at a time from the iterator so that the caller never holds them all."""
        ...
