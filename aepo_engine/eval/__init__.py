"""``python -m aepo_engine.eval``: the evaluation command (:mod:`aepo_engine.eval.cli`: options,
the model or run folder, resume, progress, reports). It reads a training run's config, so it
sits above :mod:`aepo_engine.config`; the evaluation itself is :mod:`aepo_engine.evaluation`,
which the run config's ``eval`` section and the trainer use.
"""
