"""Asynchronous training (``train.mode = "async"``, docs/async.md): a rollout process that samples
while the trainer updates, within a staleness bound.

- :mod:`.staleness`: the admission rule and the staleness metrics;
- :mod:`.messages`: what the two processes send each other, and the weights' byte path;
- :mod:`.worker`: the rollout process;
- :mod:`.client`: the trainer's handle on it;
- :mod:`.source`: the asynchronous step source (``aepo_engine.step_source``): the trainer's steps
  take their rollouts from the process and push each new version to it.
"""
