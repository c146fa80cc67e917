"""The ``agent`` config section: train an agent program through the gateway (docs/agents.md)."""
from __future__ import annotations

import msgspec

__all__ = ["AgentConfig"]


class AgentConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An agent the engine does not own, trained through its OpenAI-compatible gateway.

    Attributes:
        function: ``"package.module:function"`` or ``"path/to/file.py:function"`` of an
            ``async def run(task, client) -> reward`` (``aepo_engine.gateway.agents``); "" (the
            default): no agent, the engine's own tool loop samples the rollouts.
        command: instead of ``function``, a program run by the shell once per episode
            (``aepo_engine.gateway.agents.command_agent``: the session's base URL, the API key and
            the task in its environment; its reward the last line it prints). One of the two.
        timeout_s: an episode running longer ends as a failure (counted, left out of training).
        concurrency: episodes running at once (0: all of a step's, rollout.k per prompt).
        model_name: the model name the gateway serves (the agent's ``model=``).
        max_context_tokens: the longest context (prompt and completion) the gateway serves; a
            longer request gets ``context_length_exceeded``. 0: the prompt's length limit plus
            rollout.max_response_tokens.
        batch_window_ms: how long the gateway's generation thread waits after a request for
            others to batch with it (0: none; requests arriving while a call runs go in the next).
        port: the gateway's port on 127.0.0.1 (0: a free one).
        global_samples: m, the episodes each prompt starts from its question; the other
            rollout.k - m are AEPO's branches, forked where the branch rule says after a tool
            result (``aepo_engine.gateway.branching``). 0: rollout.k (no branching).
    """

    function: str = ""
    command: str = ""
    timeout_s: float = 300.0
    concurrency: int = 0
    model_name: str = "policy"
    max_context_tokens: int = 0
    batch_window_ms: float = 0.0
    port: int = 0
    global_samples: int = 0

    def __post_init__(self) -> None:
        if self.function and self.command:
            raise ValueError("agent.function and agent.command are two ways to give the agent: set one")
        if self.timeout_s <= 0:
            raise ValueError(f"agent.timeout_s must be > 0, got {self.timeout_s}")
        if self.concurrency < 0:
            raise ValueError(f"agent.concurrency must be >= 0, got {self.concurrency}")
        if not self.model_name:
            raise ValueError("agent.model_name must not be empty")
        if self.max_context_tokens < 0:
            raise ValueError(f"agent.max_context_tokens must be >= 0, got {self.max_context_tokens}")
        if self.batch_window_ms < 0:
            raise ValueError(f"agent.batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.global_samples < 0:
            raise ValueError(f"agent.global_samples must be >= 0 (0: rollout.k), got {self.global_samples}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"agent.port must be a TCP port (0: a free one), got {self.port}")

    @property
    def enabled(self) -> bool:
        return bool(self.function or self.command)
