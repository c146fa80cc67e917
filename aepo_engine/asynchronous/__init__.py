"""Asynchronous training (``train.mode = "async"``, docs/async.md): a rollout process that samples
while the trainer updates, within a staleness bound.

- :mod:`.staleness`: the admission rule and the staleness metrics;
- :mod:`.messages`: what the two processes send each other, and the weights' byte path;
- :mod:`.worker`: the rollout process;
- :mod:`.client`: the trainer's handle on it;
- :mod:`.loop`: the trainer's asynchronous steps (``Trainer.run`` iterates them).
"""
