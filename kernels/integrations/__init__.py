"""The AEPO loss inside other trainers: TRL and verl.

- :mod:`aepo_kernels.integrations.trl`: ``AEPOGRPOTrainer``, a ``trl.GRPOTrainer`` subclass
  taking a :class:`aepo_kernels.LossConfig` (tested with TRL 1.16.0: ``pip install
  "aepo_engine[trl]"``).
- :mod:`aepo_kernels.integrations.verl`: registers the policy loss ``aepo`` in verl (tested with
  verl 0.9.1: ``pip install "aepo_engine[verl]"``); loaded by verl itself through the
  ``verl.plugins`` entry point declared in ``setup.py``, so a verl run needs only
  ``actor_rollout_ref.actor.policy_loss.loss_mode=aepo``.

Nothing here is imported by ``aepo_kernels`` itself: the package keeps depending on torch (and
triton) only, and each submodule imports its trainer when it is imported.
"""
