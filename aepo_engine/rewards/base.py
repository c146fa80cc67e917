"""Reward result type, the name -> function registry, and ground-truth parsing.

A reward function has the signature
``(response: str, ground_truth: str | list[str], **options) -> RewardResult``, its options
declared as keyword arguments with defaults so that a misspelt option is a ``TypeError``. A
reward that reads tool results takes ``tool_spans`` too: where the engine put them in the
response (``rollout.trajectory.decode_response``), which a tool's text cannot fake; the built-in
ones all do, and :func:`build_reward_fn` passes it to those that take it.
Every reward reads each ground truth through ``text.ground_truth_answer`` (a ground truth that is a
whole solution is cut down to its ``\\boxed{}`` or its ``#### answer``).
``response`` is the model's text only (no prompt). Functions are pure and cheap, so the caller
may run them in a thread or process pool; nothing here touches torch.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from aepo_engine.plugins import import_user_code
from aepo_engine.rewards.config import RULES, RULES_RENAMED, RewardConfig  # re-exported: their old home

__all__ = ["RULES", "RULES_RENAMED", "RewardConfig", "RewardResult", "RewardFn", "build_reward_fn", "register_reward",
           "get_reward", "list_rewards", "as_ground_truths", "as_references"]


@dataclass(frozen=True)
class RewardResult:
    """Outcome of scoring one response.

    Attributes:
        score: the scalar reward fed to the advantage estimator.
        correct: whether the answer counts as right for accuracy metrics (not the same as
            ``score > 0``: an F1 of 0.4 is a positive reward but not a correct answer).
        details: free-form diagnostics, e.g. ``{"format_error": "...", "f1": 0.67}``.
    """

    score: float
    correct: bool
    details: dict[str, Any] = field(default_factory=dict)


class RewardFn(Protocol):
    def __call__(self, response: str, ground_truth: Any, **options: Any) -> RewardResult: ...


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``.

    Args:
        name: registry key; registering the same name twice is an error (it would silently
            replace the reward a config refers to).

    Returns:
        The decorator, which returns the function unchanged.
    """
    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered (by {_REGISTRY[name]!r})")
        _REGISTRY[name] = fn
        return fn
    return decorator


def get_reward(name: str) -> RewardFn:
    """Look up a registered reward function.

    Args:
        name: registry key, e.g. ``"deep_research"``.

    Returns:
        The reward function.

    Raises:
        KeyError: unknown name; the message lists the registered names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered rewards: {list_rewards()}") from None


def list_rewards() -> list[str]:
    """Names of all registered reward functions, sorted."""
    return sorted(_REGISTRY)


def build_reward_fn(cfg: RewardConfig) -> Callable[..., RewardResult]:
    """``(response, ground_truth, tool_spans=None) -> RewardResult`` with the configured options
    bound (``tool_spans`` goes to a reward that takes it).

    Raises:
        ValueError: an unknown reward name, an option the reward does not take, or
            ``rules = "authors"`` for a reward that has no authors' version (checked here, not at
            the first scored response).
    """
    if cfg.path:
        import_user_code(cfg.path, "reward.path")
    try:
        reward = get_reward(cfg.name)
    except KeyError as err:
        raise ValueError(err.args[0]) from None
    options = dict(cfg.options)
    if "tool_spans" in options:
        raise ValueError("reward.options cannot set tool_spans: the engine passes where it put the tool results")
    try:
        inspect.signature(reward).bind("", "", **options)
    except TypeError as err:
        raise ValueError(f"reward.options {sorted(options)} do not fit reward {cfg.name!r}: {err}") from None
    if "rules" in inspect.signature(reward).parameters:
        options["rules"] = cfg.rules
    elif cfg.rules != "project":
        raise ValueError(f"reward.rules = {cfg.rules!r} needs a reward with an authors' version (deep_research); "
                         f"{cfg.name!r} has none: the authors trained with deep_research only")
    takes_spans = "tool_spans" in inspect.signature(reward).parameters

    def reward_fn(response: str, ground_truth: Any, tool_spans: Any = None) -> RewardResult:
        spans = {"tool_spans": tool_spans} if takes_spans and tool_spans is not None else {}
        return reward(response, ground_truth, **options, **spans)

    return reward_fn


# ---------------------------------------------------------------------------------------------
# Ground truth as stored in the datasets: a string, a list, or a JSON-encoded list of strings.


def as_ground_truths(ground_truth: Any) -> list[str]:
    """Normalise a ground-truth field to a non-empty list of ground-truth strings.

    Accepted forms: a string; a list/tuple (or anything iterable that is not a string, e.g. a
    numpy array) of strings or numbers; a number (AIME answers are ints); a JSON-encoded list
    of strings such as ``'["New York", "NYC"]'``. A JSON list is only decoded when *every*
    element is a string: ``"[1, 2]"`` and ``"[-1, 0)"`` are maths intervals, not lists, and are
    kept whole.

    Args:
        ground_truth: the raw field (``reward_model.ground_truth`` in the parquet files).

    Returns:
        The ground-truth strings (at least one).

    Raises:
        ValueError: ``None`` or an empty list.
    """
    if ground_truth is None:
        raise ValueError("ground truth is None")
    if isinstance(ground_truth, str):
        truths = _decode_json_list(ground_truth) or [ground_truth]
    elif isinstance(ground_truth, (int, float)):
        truths = [str(ground_truth)]
    else:
        truths = [str(item) for item in ground_truth]
    if not truths:
        raise ValueError("ground truth is an empty list")
    return truths


as_references = as_ground_truths  # its old name ("reference" is the kernels' fp32 oracle now), for old reward code


def _decode_json_list(text: str) -> list[str] | None:
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return None
    try:
        value = json.loads(stripped)
    except ValueError:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None
