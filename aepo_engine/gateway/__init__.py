"""Train agents the engine does not own: an OpenAI-compatible gateway in front of the run's
backend that records each episode token-exact (:mod:`.server`, :mod:`.conversation`), the runner
of agent functions written against the ``openai`` client (:mod:`.agents`) and the step's rollouts
from them (:mod:`.rollout`). docs/agents.md.

The ``agent`` config section (:mod:`.config`) loads nothing else: the other names load on first use.
"""
from aepo_engine.lazy import lazy_exports

__all__ = ["AgentConfig", "AgentRollout", "Gateway", "GatewayError", "Session"]

__getattr__ = lazy_exports(__name__, {"AgentConfig": ".config", "AgentRollout": ".rollout", "Gateway": ".server",
                                      "GatewayError": ".conversation", "Session": ".conversation"})
