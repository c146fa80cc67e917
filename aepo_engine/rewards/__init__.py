"""Reward functions, looked up by name: ``get_reward("deep_research")(response, ground_truth)``.

Registered: ``deep_research`` (docs/algorithm.md §3; ``rules="authors"`` is the AEPO/ARPO
authors' reward, :mod:`.authors`), ``qa_em``, ``qa_f1`` and ``math``. Importing this package
registers all of them; a new reward is a function decorated with ``@register_reward("name")`` in
a module imported here. docs/scoring.md compares the engine's and the authors' rules.
"""
from .base import (RewardConfig, RewardFn, RewardResult, as_ground_truths, as_references, build_reward_fn, get_reward,
                   list_rewards, register_reward)
from .text import exact_match, extract_answer, extract_boxed, normalize_answer, token_f1
from . import deep_research as _deep_research  # noqa: F401  (registers "deep_research")
from . import math_answer as _math_answer  # noqa: F401  (registers "math")
from . import qa as _qa  # noqa: F401  (registers "qa_em", "qa_f1")

__all__ = ["RewardConfig", "RewardFn", "RewardResult", "build_reward_fn", "as_ground_truths", "as_references", "get_reward",
           "list_rewards", "register_reward", "exact_match", "extract_answer", "extract_boxed", "normalize_answer",
           "token_f1"]
