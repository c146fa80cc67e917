"""Policy training: padded token batches, the optimizer section and the (FSDP2) policy worker."""
from aepo_engine.training.batch import IGNORE_INDEX, TokenBatch, concat_rows
from aepo_engine.training.optim import OptimConfig, build_lr_scheduler
from aepo_engine.training.policy import PolicyConfig, PolicyModel, PolicyWorker

__all__ = ["IGNORE_INDEX", "OptimConfig", "PolicyConfig", "PolicyModel", "PolicyWorker", "TokenBatch",
           "build_lr_scheduler", "concat_rows"]
