"""The ``reward`` config section, and the names of the two sets of scoring rules it shares with
``eval`` (apart from the reward functions, per the rule of ``aepo_engine.config``)."""
from __future__ import annotations

from typing import ClassVar

import msgspec

__all__ = ["RULES", "RULES_RENAMED", "RewardConfig"]

# Whose scoring rules apply: the project's own ("project"), or the AEPO/ARPO authors' code
# reproduced ("authors"; docs/scoring.md lists every difference). Shared by reward.rules,
# eval.scoring and eval.judge.prompt. RULES_RENAMED: their old names ("engine" before the glossary
# gave that word one meaning, "reference" before that; docs/glossary.md), still loaded from configs
# with a warning (config_loader, a section's RENAMED_VALUES); Python callers get the new names only.
RULES = ("project", "authors")
RULES_RENAMED = {"engine": "project", "reference": "authors"}


class RewardConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Reward function.

    Attributes:
        name: a registered reward (aepo_engine.rewards): deep_research, qa_em, qa_f1, math, or one
            that ``path`` registers.
        path: a reward of your own outside the package: a .py file (absolute or relative to the
            working directory) or an importable module, imported before ``name`` is looked up; its
            ``@register_reward("name")`` functions join the registry (verl's
            custom_reward_function.path); empty = the built-in rewards only.
        options: keyword options of that reward (e.g. {tool_bonus = 0.1}).
        rules: "project" (the project's reward rules) or "authors" (the AEPO/ARPO authors' reward
            reproduced: <think> required, tags counted anywhere, the bonus for closing tool tags
            anywhere; deep_research only; see docs/scoring.md).
    """

    name: str = "deep_research"
    path: str = ""
    options: dict[str, float | bool | str] = msgspec.field(default_factory=dict)
    rules: str = "project"

    RENAMED_VALUES: ClassVar[dict[str, dict[str, str]]] = {"rules": RULES_RENAMED}

    def __post_init__(self) -> None:
        if self.rules not in RULES:
            raise ValueError(f"reward.rules must be one of {', '.join(RULES)}, got {self.rules!r}")
        if "rules" in self.options:
            raise ValueError("set reward.rules, not reward.options.rules (one place for one setting)")
