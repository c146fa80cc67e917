"""Entropy-balanced rollouts: the scheduler (pre-monitoring, branching, budget), trajectories,
entropy measures and the generation backends (``rollout.backends``).

The modules are imported by name (``aepo_engine.rollout.scheduler``, ...); this file makes the
folder a regular package so that a non-editable install (a wheel) ships it.
"""
