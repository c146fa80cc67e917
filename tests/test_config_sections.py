"""Where config sections live (the rule in ``aepo_engine.config``'s docstring): reading the run
config's defaults loads no torch, and every section sits in a section module."""
import subprocess
import sys

import msgspec

from aepo_engine.config import TrainConfig
from aepo_engine.config_loader import _section_class

HEAVY = ("torch", "transformers", "vllm", "triton")
# The section modules: a package's config.py, the top-level modules' shared one, the kernels' loss.
SECTION_MODULES = ("aepo_engine.sections", "aepo_engine.config")


def test_reading_the_defaults_imports_no_torch():
    """In a fresh interpreter: import the run config, build the defaults and a preset, list their
    problems, dump them and print the help; none of this may load torch, transformers, vLLM or triton
    (it did: the sections lived in the modules of the FSDP worker, the checkpoints and the kernels)."""
    code = ("import sys\n"
            "from aepo_engine.config import TrainConfig, config_problems, load_train_config\n"
            "from aepo_engine.config_loader import dump_config, format_help\n"
            "cfg = TrainConfig()\n"
            "assert 'rollout_correction' in dump_config(cfg) and 'loss' in dump_config(cfg)\n"
            "assert config_problems(cfg) and format_help(TrainConfig)\n"
            "assert load_train_config(['--preset', 'embedded']).task.source == 'synthetic'\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def _sections(cls: type, path: str = ""):
    for field in msgspec.structs.fields(cls):
        section = _section_class(field.type)
        if section is not None:
            yield f"{path}{field.name}", section
            if issubclass(section, msgspec.Struct):
                yield from _sections(section, f"{path}{field.name}.")


def test_every_section_lives_in_a_section_module():
    found = dict(_sections(TrainConfig))
    assert {"policy", "policy.loss", "checkpoint", "logging", "task.warm_start", "task.synthetic",
            "backend", "reward", "optim", "rollout_correction"} <= set(found)
    misplaced = {path: cls.__module__ for path, cls in found.items()
                 if not (cls.__module__.endswith(".config") or cls.__module__ in SECTION_MODULES)}
    assert not misplaced, f"sections outside a config.py / aepo_engine.sections: {misplaced}"


def test_old_homes_still_export_their_sections():
    from aepo_engine import checkpoint, metrics, sft
    from aepo_engine.rewards import base
    from aepo_engine.rollout import backends
    from aepo_engine.tasks import synthetic
    from aepo_engine.training import optim, policy, rollout_correction
    cfg = TrainConfig()
    assert policy.PolicyConfig is type(cfg.policy) and optim.OptimConfig is type(cfg.optim)
    assert rollout_correction.RolloutCorrectionConfig is type(cfg.rollout_correction)
    assert checkpoint.CheckpointConfig is type(cfg.checkpoint) and metrics.LoggingConfig is type(cfg.logging)
    assert sft.SFTConfig is type(cfg.task.warm_start) and synthetic.SyntheticTaskConfig is type(cfg.task.synthetic)
    assert base.RewardConfig is type(cfg.reward) and backends.BackendConfig is type(cfg.backend)


def test_packages_load_their_torch_modules_on_first_use():
    """``from aepo_engine.training import PolicyWorker`` (and the kernels' names) still work; a name
    a package does not have is an AttributeError, not a failed import of some module."""
    import aepo_kernels
    from aepo_engine import evaluation, models, training
    from aepo_engine.training import PolicyWorker
    from aepo_engine.training.policy import PolicyWorker as defined
    assert PolicyWorker is defined and training.PolicyWorker is defined
    assert models.build_tiny_qwen3.__module__ == "aepo_engine.models.tiny_qwen3"
    assert evaluation.evaluate.__module__ == "aepo_engine.evaluation.core"
    assert aepo_kernels.aepo_policy_loss.__module__ == "aepo_kernels.api"
    for package in (aepo_kernels, evaluation, models, training):
        try:
            package.no_such_name
        except AttributeError as err:
            assert "no_such_name" in str(err)
        else:
            raise AssertionError(f"{package.__name__}.no_such_name did not raise")
