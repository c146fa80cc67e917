"""Policy training: padded token batches, the optimizer schedule and the (FSDP2) policy worker; the
sections they read are in ``training.config`` (imported here at once; the torch modules on first use)."""
from typing import TYPE_CHECKING

from aepo_engine.lazy import lazy_exports
from aepo_engine.training.config import OptimConfig, PolicyConfig, RolloutCorrectionConfig

if TYPE_CHECKING:
    from aepo_engine.training.batch import IGNORE_INDEX, TokenBatch, concat_rows
    from aepo_engine.training.optim import build_lr_scheduler
    from aepo_engine.training.policy import PolicyModel, PolicyWorker

__getattr__ = lazy_exports(__name__, {
    "IGNORE_INDEX": ".batch", "TokenBatch": ".batch", "concat_rows": ".batch",
    "build_lr_scheduler": ".optim", "PolicyModel": ".policy", "PolicyWorker": ".policy",
})

__all__ = ["IGNORE_INDEX", "OptimConfig", "PolicyConfig", "PolicyModel", "PolicyWorker", "RolloutCorrectionConfig",
           "TokenBatch", "build_lr_scheduler", "concat_rows"]
