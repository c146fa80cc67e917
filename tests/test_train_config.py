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


def test_help_shows_the_defaults_a_run_gets_not_the_section_classes_own():
    from aepo_engine.config_loader import format_help
    from aepo_engine.rollout.config import RolloutConfig
    from aepo_engine.train_config import OptimConfig

    # the embedded default builds these sections with other values than their classes' defaults
    assert RolloutConfig().k != TrainConfig().rollout.k == 8
    assert OptimConfig().lr != TrainConfig().optim.lr == 3e-4
    text = format_help(TrainConfig)
    for flag in ("--rollout.k  int = 8\n", "--optim.lr  float = 0.0003\n",
                 f"--task.warm_start.steps  int = {TrainConfig().task.warm_start.steps}\n",
                 "--data.max_examples  int | None = none\n"):
        assert flag in text, flag
