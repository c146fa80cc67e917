"""Algorithm maths, kept apart from orchestration: the rollout's m and branch probability
(docs/algorithm.md §1a, §1c), advantages (§2a) and their broadcast."""
from .advantages import broadcast_to_tokens, dense_group_index, group_advantages
from .branching import branch_probability, global_sample_count, sigmoid

__all__ = ["branch_probability", "broadcast_to_tokens", "dense_group_index", "global_sample_count",
           "group_advantages", "sigmoid"]
