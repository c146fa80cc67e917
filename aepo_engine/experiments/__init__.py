"""Experiments built on the trainer: the algorithm-comparison grid (``compare``) and its
results (``results``)."""
