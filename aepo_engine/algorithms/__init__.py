"""Algorithm maths, kept apart from orchestration: advantages (docs/algorithm.md §2a) and their broadcast."""
from .advantages import broadcast_to_tokens, dense_group_index, group_advantages

__all__ = ["broadcast_to_tokens", "dense_group_index", "group_advantages"]
