"""The run config: overriding one field of a section keeps that section's embedded defaults."""
from aepo_engine.config import EMBEDDED_POLICY, EMBEDDED_ROLLOUT, TrainConfig
from aepo_engine.config_loader import dump_config, load_config, loads_config


def test_override_keeps_the_sections_embedded_defaults():
    cfg = load_config(TrainConfig, overrides=["--rollout.seed=1", "--task.warm_start.seed=1",
                                              "--policy.ppo_mini_batch_size=4"])
    assert cfg.rollout.seed == 1 and cfg.rollout.k == EMBEDDED_ROLLOUT.k == 8
    assert cfg.rollout.max_response_tokens == EMBEDDED_ROLLOUT.max_response_tokens
    assert cfg.task.warm_start.seed == 1 and cfg.task.warm_start.steps == TrainConfig().task.warm_start.steps
    assert cfg.policy.ppo_mini_batch_size == 4 and cfg.policy.param_dtype == EMBEDDED_POLICY.param_dtype


def test_resolved_config_round_trips():
    cfg = load_config(TrainConfig, overrides=["--policy.loss.clip=gppo", "--rollout.k=4"])
    assert loads_config(TrainConfig, dump_config(cfg)) == cfg
