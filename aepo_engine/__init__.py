"""aepo_engine: entropy-balanced rollouts, tools, rewards and training for AEPO."""
