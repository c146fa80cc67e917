"""The whole run's configuration: one typed tree, one default per field, presets as files.

Where a section lives (one rule): in the ``config.py`` of the package whose code reads it --
``rollout/config.py`` (``RolloutConfig``), ``rollout/backends/config.py`` (``BackendConfig``),
``tools/config.py``, ``rewards/config.py``, ``data/config.py``, ``models/config.py``,
``tasks/config.py``, ``evaluation/config.py``, ``training/config.py`` (``PolicyConfig``,
``OptimConfig``, ``RolloutCorrectionConfig``) and the kernels' ``aepo_kernels/config.py``
(``LossConfig``, the ``policy.loss`` section). The top-level modules are no package: the sections of
checkpoint.py, metrics.py and sft.py share ``aepo_engine/sections.py``; the run's own (``TrainConfig``,
its loop ``TrainLoopConfig``) are here. A section module imports only the standard library, msgspec,
``aepo_engine.errors`` and other section modules, and a package's ``__init__`` loads its torch
modules on first use (``aepo_engine.lazy``), so ``import aepo_engine.config`` -- reading, checking
and dumping the defaults -- loads neither torch nor transformers nor vLLM
(``tests/test_config_sections.py`` checks it in a fresh interpreter). The old homes re-export their
section (``from aepo_engine.training.policy import PolicyConfig`` still works).

This module composes the sections, adds the run loop, derives the sub-seeds from the root seed,
lists the cross-section problems of a config, and knows the presets. Loading, command-line
overrides (``--section.key=value``), unknown-key errors and TOML dumps are the generic machinery
of :mod:`aepo_engine.config_loader`.

Defaults: every field's default is the one in its section class, and those are the values for a
real-model run (docs/algorithm.md §3 where it names one). Nothing else holds a default.

Presets are partial TOML files in ``aepo_engine/presets/``, applied in the order given, below the
user's ``--config`` files and overrides. ``embedded`` is the laptop-CPU job (a generated tool-use
task, a tiny local Qwen3, a short warm start, then AEPO); ``python -m aepo_engine.train`` applies it
when neither ``--config`` nor ``--preset`` is given. ``qwen3_14b_deep_research`` is the paper's run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import msgspec

from aepo_engine.config_loader import ConfigError, load_config, pop_option
from aepo_engine.data import data_problems
from aepo_engine.data.config import DataConfig
from aepo_engine.evaluation.config import EvalConfig
from aepo_engine.gateway.config import AgentConfig
from aepo_engine.models.config import ModelConfig
from aepo_engine.rewards.config import RewardConfig
from aepo_engine.rollout.backends.config import BackendConfig
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.sections import CheckpointConfig, LoggingConfig
from aepo_engine.seeding import SEED_OFFSETS
from aepo_engine.tasks.config import TaskConfig
from aepo_engine.tools import tool_problems
from aepo_engine.tools.config import ToolsConfig
from aepo_engine.training.config import OptimConfig, PolicyConfig, RolloutCorrectionConfig

__all__ = ["DEFAULT_PRESET", "PRESETS_DIR", "ResolvedArgs", "TrainConfig", "TrainLoopConfig", "config_problems",
           "list_presets", "load_train_config", "preset_path", "split_train_args"]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
# What `python -m aepo_engine.train` runs when given neither --config nor --preset.
DEFAULT_PRESET = "embedded"


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    return path


class TrainLoopConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The RL loop.

    Attributes:
        steps: RL steps (each: rollouts for prompts_per_step prompts, then PPO updates); none =
            epochs passes over the training prompts, ceil(epochs * prompts / prompts_per_step).
        epochs: passes over the training prompts when steps is none (the paper: 5 over
            hard_search_1k's 1,071 prompts at 64 per step = 84 steps).
        prompts_per_step: prompts sampled per step (each gets rollout.k trajectories).
        mode: "sync": each step samples its rollouts, then updates, then pushes the weights, one
            after the other. "async": a rollout process samples while the trainer updates
            (docs/async.md): trajectories in flight continue under new weights (partial rollouts),
            every token records the policy version that sampled it, and the loss corrects for
            staleness (decoupled PPO: rollout_correction.mode "auto").
        max_staleness: eta, for mode "async": an update may use a token sampled by a policy at most
            this many versions older than the one being updated; a prompt starts only when all
            its samples will be trained within eta (admission control; nothing is dropped).
            0 samples each step's rollouts with the weights of the step before, as "sync" does
            (and gives the same run, bit for bit).
        collective_timeout_minutes: under torchrun, how long a rank waits for the others at a
            gather or barrier before the run stops with an error naming this setting. Each rank
            samples its own agentic rollouts (tool calls, HTTP search) and rank 0 alone writes
            checkpoint exports and asks the judge, so a rank may wait long for a slower one:
            hours, not torch's 10-minute NCCL default. Lower it to find a hung rank sooner. It is
            the timeout of the gloo group those waits run on (``aepo_engine.distributed``).
        device_collective_timeout_minutes: on CUDA, the NCCL group's timeout: FSDP2's and the
            weight sync's collectives, which start only once every rank has passed the step's
            gather of rollouts, so they never wait for a slower rank's tools: a hung GPU
            collective stops the run after this long, not after collective_timeout_minutes.
        torch_threads: CPU threads of torch's intra-op pool in this process
            (``torch.set_num_threads``, set before the warm start, the policy and the HF backend
            are built); 0 leaves torch's default (one per core). On a CPU shared with other jobs,
            1 avoids the threads of one matmul waiting on each other: SmolLM2-135M decode on this
            2-core machine at load 14 ran 5x faster in wall time and used 7x less CPU time with 1
            thread than with 2 (bench/results/smollm2_trials.jsonl, docs/experiments.md). In
            async mode with max_staleness >= 1 on CPU, 0 splits the cores between the trainer
            and the rollout process (which compute at the same time) and a value gives each
            process that many (``asynchronous.source.cpu_thread_split``).
    """

    steps: int | None = None
    epochs: int = 5
    prompts_per_step: int = 64
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1
    collective_timeout_minutes: float = 180.0
    device_collective_timeout_minutes: float = 10.0
    torch_threads: int = 0

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 0:
            raise ValueError(f"steps must be >= 0 (or none for epochs), got {self.steps}")
        if self.epochs < 1 or self.prompts_per_step < 1:
            raise ValueError("epochs and prompts_per_step must be >= 1")
        if not self.collective_timeout_minutes > 0:
            raise ValueError(f"collective_timeout_minutes must be > 0, got {self.collective_timeout_minutes}")
        if not self.device_collective_timeout_minutes > 0:
            raise ValueError(f"device_collective_timeout_minutes must be > 0, got "
                             f"{self.device_collective_timeout_minutes}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0 (0 = torch's default), got {self.torch_threads}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (policy versions), got {self.max_staleness}")

    @property
    def asynchronous(self) -> bool:
        return self.mode == "async"

    @property
    def stale_tokens(self) -> bool:
        """Whether an update may train on tokens sampled by an older policy (async, eta >= 1)."""
        return self.asynchronous and self.max_staleness > 0

    def resolved_steps(self, num_prompts: int) -> int:
        """RL steps of the run for ``num_prompts`` training prompts."""
        if self.steps is not None:
            return self.steps
        return -(-self.epochs * num_prompts // self.prompts_per_step)


def apply_torch_threads(threads: int, log=print) -> None:
    """``train.torch_threads`` (and the eval command's ``torch_threads``): size torch's intra-op
    pool (0 leaves torch's default) and say so."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
        log(f"[cpu] torch threads: {torch.get_num_threads()}")


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """An AEPO training run.

    Sub-seeds left at none (rollout.seed, eval.seed, data.shuffle_seed, model.tiny.seed,
    task.synthetic.seed, task.warm_start.seed) are derived from ``seed`` when the config is built
    (``aepo_engine.seeding``): build a new config to change the root seed, since
    ``msgspec.structs.replace(cfg, seed=...)`` keeps the sub-seeds already derived.

    Attributes:
        seed: root seed: python, numpy and torch, and every sub-seed left at none.
        run_dir: output folder: checkpoints, metrics.jsonl, plots, samples, the resolved config
            (relative checkpoint.dir and logging.dir are inside it).
        model: the policy model.
        backend: the generation backend.
        task: the task (data files, or the generated task of the embedded preset).
        data: dataset files and how rows become prompts.
        rollout: entropy-balanced rollout (AEPO spec section 1); its temperature is also the one
            the policy scores log-probs and entropies with.
        tools: search and python tools.
        reward: the reward function.
        policy: the policy update (loss, micro-batching, FSDP2, precision).
        rollout_correction: importance weights for the gap between the sampler's and the
            trainer's log-probs (truncated / masked IS).
        optim: optimizer and learning-rate schedule.
        train: the RL loop.
        eval: held-out evaluation.
        checkpoint: checkpoints and resume.
        logging: metrics, TensorBoard, plots, samples.
        agent: an agent program trained through the OpenAI-compatible gateway (none by default:
            the engine's own tool loop; docs/agents.md).
    """

    seed: int = 0
    run_dir: str = "runs/aepo"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    backend: BackendConfig = msgspec.field(default_factory=BackendConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    tools: ToolsConfig = msgspec.field(default_factory=ToolsConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    rollout_correction: RolloutCorrectionConfig = msgspec.field(default_factory=RolloutCorrectionConfig)
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    train: TrainLoopConfig = msgspec.field(default_factory=TrainLoopConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        for key, offset in SEED_OFFSETS.items():
            _derive(self, key.split("."), self.seed + offset)


def _derive(node: Any, path: list[str], value: int) -> Any:
    """Set the leaf ``path`` of ``node`` to ``value`` if it is None; returns the (new) node.
    Sections are frozen: a changed child is a replaced copy, set on its parent."""
    name = path[0]
    if len(path) == 1:
        return msgspec.structs.replace(node, **{name: value}) if getattr(node, name) is None else node
    child = getattr(node, name)
    new = _derive(child, path[1:], value)
    if new is not child:
        if isinstance(node, TrainConfig):
            msgspec.structs.force_setattr(node, name, new)  # inside __post_init__
        else:
            node = msgspec.structs.replace(node, **{name: new})
    return node


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every cross-section problem of a run config (all of them, not the first).

    These are the rules that need more than one section, or inputs a real run must be given
    (model path, data): a config with problems is still built (``--help`` and ``--dry-run`` show
    it), but the trainer refuses to start it.

    Returns:
        One message per problem, each naming the fields and saying why.
    """
    problems = []
    if cfg.task.source == "files":
        if not cfg.model.path:
            problems.append("model.path is required with task.source='files': a local Hugging Face model "
                            "directory (only the synthetic task builds a model of its own)")
        if not cfg.data.train_files:
            problems.append("data.train_files is required with task.source='files' because there is nothing "
                            "else to train on")
        if cfg.eval.every_n_steps and not cfg.data.eval_files and not cfg.eval.files:
            problems.append(f"eval.every_n_steps={cfg.eval.every_n_steps} but data.eval_files and eval.files are "
                            "empty: there is no held-out set to evaluate")
    search = cfg.tools.search
    if "search" in cfg.tools.enabled and search.backend == "served" and not search.corpus_path \
            and cfg.task.source != "synthetic":
        problems.append("tools.search.corpus_path is required with tools.search.backend='served' because the "
                        "server indexes that file (only the synthetic task brings a corpus of its own)")
    if cfg.agent.enabled and cfg.train.asynchronous:
        problems.append("an agent (agent.function or agent.command) runs in synchronous training (train.mode = 'sync'): the gateway serves "
                        "the trainer's own engine, which an asynchronous run does not have")
    if cfg.agent.enabled and cfg.eval.files:
        problems.append("eval.files are asked by the engine's own tool loop; with an agent the held-out "
                        "questions are asked by the agent: leave eval.files empty")
    context = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    if cfg.backend.kind == "vllm" and cfg.backend.max_model_len < context:
        problems.append(f"backend.max_model_len={cfg.backend.max_model_len} is shorter than "
                        f"data.max_prompt_tokens + rollout.max_response_tokens = {context}: vLLM would "
                        "refuse or cut a long prompt's response")
    if cfg.backend.placement == "split" and not cfg.train.asynchronous:
        problems.append("backend.placement='split' needs train.mode='async' because the engines on GPUs of their "
                        "own run in a rollout process (train.max_staleness=0 gives the synchronous schedule)")
    problems += data_problems(cfg.data) + tool_problems(cfg.tools)
    return problems


# --- command line ---------------------------------------------------------------------------------

@dataclass
class ResolvedArgs:
    """A train command line taken apart.

    Attributes:
        files: config files in load order (presets first, then --config files).
        presets: the preset names applied (``[DEFAULT_PRESET]`` when none and no --config given).
        overrides: the ``--section.key=value`` tokens.
    """

    files: list[Path]
    presets: list[str]
    overrides: list[str]

    def describe(self) -> str:
        """Where the defaults come from, for ``--help`` and the resolved config's header."""
        parts = ["section defaults (real-model run)"]
        parts += [f"preset {name!r} ({preset_path(name)})" for name in self.presets]
        parts += [f"config {p}" for p in self.files[len(self.presets):]]
        return " + ".join(parts)


def split_train_args(argv: Sequence[str]) -> ResolvedArgs:
    """``--preset NAME`` (repeatable), ``--config FILE`` (repeatable) and overrides.

    With neither ``--preset`` nor ``--config`` the embedded preset is applied (the CPU job the
    README's first command runs); give ``--config`` alone to start from the section defaults.
    """
    presets, rest = pop_option(list(argv), "--preset")
    configs, overrides = pop_option(rest, "--config")
    if not presets and not configs:
        presets = [DEFAULT_PRESET]
    files = [preset_path(name) for name in presets] + [Path(p) for p in configs]
    return ResolvedArgs(files, presets, overrides)


def load_train_config(argv: Sequence[str]) -> TrainConfig:
    """The ``TrainConfig`` a train command line describes (presets, files, overrides).

    Raises:
        ConfigError: unknown preset or key, bad value, failed check.
    """
    args = split_train_args(argv)
    return load_config(TrainConfig, path=args.files, overrides=args.overrides)
