"""Fakes shared by the scheduler, evaluation and rollout-measure tests: a character-level
scripted model (:class:`ScriptedBackend`), a scripted tool runner and a tokenizer. They stand in
for the model only where the logic under test is the scheduler's (branching, budgets, batching);
the real backends and tools are tested with the real parts.

The scripted backend: a policy function maps the decoded context to the next segment's text and
per-token entropies; the backend applies stop strings, EOS and max_new_tokens like a real one and
returns seed-dependent log-probs.
"""
from __future__ import annotations

from typing import Callable, Sequence

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.protocol import GenOutput, GenRequest
from aepo_engine.rollout.scheduler import EntropyBalancedRollout
from aepo_engine.tools import ToolResult

EOS = 1

class CharTokenizer:
    """One token per character (id = ord + 2); id 1 is EOS."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) + 2 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 2) for i in ids if i >= 2)


# policy(context_text, request) -> (segment text, entropy per token, ends with EOS)
Policy = Callable[[str, GenRequest], tuple[str, float, bool]]


class ScriptedBackend:
    """A GenerationBackend whose next segment is given by ``policy`` (see module docstring)."""

    entropy_is_exact = True

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.tokenizer = CharTokenizer()
        self.batches: list[list[GenRequest]] = []
        self.outputs: dict[tuple[int, ...], list[GenOutput]] = {}  # context -> outputs

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (EOS,)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        self.batches.append(list(requests))
        return [self._one(r) for r in requests]

    def _one(self, request: GenRequest) -> GenOutput:
        text, entropy, eos = self.policy(self.tokenizer.decode(request.prompt_ids), request)
        finish, stop = ("eos" if eos else "length"), None
        for s in request.stop_strings:
            if s in text:
                text, finish, stop, eos = text[: text.index(s) + len(s)], "stop", s, False
        ids = self.tokenizer.encode(text) + ([EOS] if eos else [])
        if len(ids) > request.max_new_tokens:
            ids, finish, stop = ids[: request.max_new_tokens], "length", None
        logprobs = [-((request.seed + 7 * i) % 97) / 100 - 0.01 for i in range(len(ids))]
        out = GenOutput(ids, logprobs, [entropy] * len(ids), finish, stop,
                        self.tokenizer.decode(ids))
        self.outputs.setdefault(request.prompt_ids, []).append(out)
        return out

    def update_weights(self, state_dict) -> None:
        pass


class CutAfter:
    """An abort event that reports set from its ``n``-th check on (a weight update mid-segment)."""

    def __init__(self, n: int):
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.n


class ScriptedRunner:
    """Tool runner stand-in: result text names the tool, payload and call number."""

    def __init__(self, tools: Sequence[str] = ("search", "python")) -> None:
        self.tools = {name: None for name in tools}
        self.batches: list[list] = []

    def run(self, calls):
        self.batches.append(list(calls))
        n = sum(len(b) for b in self.batches)
        return [ToolResult(f"{c.tool}({c.payload})#{n - len(calls) + i}", ok=True)
                for i, c in enumerate(calls)]


def tool_agent(n_calls: int, h_first: float = 1.0, h_after: float = 1.0,
               seed_in_text: bool = False) -> Policy:
    """Calls search ``n_calls`` times, then answers and ends with EOS."""

    def policy(context: str, request: GenRequest):
        done = context.count("<result>")
        entropy = h_first if done == 0 else h_after
        tag = f"s{request.seed % 10}" if seed_in_text else "q"
        if done < n_calls:
            return f"think{done} <search>{tag}{done}</search>", entropy, False
        return f"<answer>{tag}</answer>", entropy, True

    return policy


def make(policy: Policy, runner=None, **overrides) -> tuple[EntropyBalancedRollout,
                                                              ScriptedBackend, ScriptedRunner]:
    backend = ScriptedBackend(policy)
    runner = runner if runner is not None else ScriptedRunner()
    fields = dict(k=4, n_entropy_tokens=4, max_response_tokens=400, max_tokens_per_segment=100)
    fields.update(overrides)
    return EntropyBalancedRollout(backend, runner, RolloutConfig(**fields)), backend, runner
