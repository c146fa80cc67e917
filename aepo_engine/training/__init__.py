"""Policy training: padded token batches and the (FSDP2) policy worker that updates the model."""
from aepo_engine.training.batch import IGNORE_INDEX, TokenBatch, concat_rows
from aepo_engine.training.policy import PolicyConfig, PolicyModel, PolicyWorker, build_lr_scheduler

__all__ = ["IGNORE_INDEX", "PolicyConfig", "PolicyModel", "PolicyWorker", "TokenBatch", "build_lr_scheduler",
           "concat_rows"]
