"""The sections of aepo_engine's top-level modules: ``checkpoint`` (checkpoint.py), ``logging``
(metrics.py) and ``task.warm_start`` (sft.py).

A package's sections live in its ``config.py`` (the rule of :mod:`aepo_engine.config`); these three
modules are no package, and sit below packages that import them (evaluation reads metrics, the
synthetic task runs the warm start), so their sections cannot live in ``aepo_engine/config.py``
(which composes those packages' sections) without a circle: they share this module. Each module
re-exports its own section, so ``from aepo_engine.checkpoint import CheckpointConfig`` still works.
"""
from __future__ import annotations

import importlib.util
from typing import Literal

import msgspec

from aepo_engine.errors import require
from aepo_engine.training.config import OptimConfig

__all__ = ["CheckpointConfig", "LoggingConfig", "SFTConfig"]


class CheckpointConfig(msgspec.Struct, kw_only=True):
    """Checkpoint saving and resuming.

    Attributes:
        dir: Directory holding step_XXXXXX/ checkpoints and the `latest` marker.
        every_n_steps: Save every N optimizer steps; 0 = only at the end of training.
        keep_last: Keep this many most recent checkpoints (the one `latest` names is never deleted,
            and a checkpoint found damaged does not count).
        resume: "auto" resumes from the newest intact checkpoint in dir if there is one (a damaged
            one is skipped with a warning), "never" starts fresh, any other value is the path of a
            step_XXXXXX directory (or of a checkpoint dir: its newest intact one) to resume from.
        save_at_end: Save a final checkpoint when training finishes.
        export_hf: Write the model as a Hugging Face directory (safetensors in the model's own
            dtype, config, tokenizer; loadable with from_pretrained) into the final checkpoint; the
            training state is saved either way.
        hf_export_every: Also export every N steps' checkpoint (a checkpoint step that is a
            multiple of N); 0 = only the final one (each export is the model's size again on disk).
        on_save_error: What a checkpoint that cannot be written (a full disk) does: "stop" ends
            the run with one error line (the intact checkpoint a resume will use named), "warn"
            says so and trains on, trying again at the next checkpoint.
    """

    dir: str = "checkpoints"
    every_n_steps: int = 50
    keep_last: int = 3
    resume: str = "auto"
    save_at_end: bool = True
    export_hf: bool = True
    hf_export_every: int = 0
    on_save_error: Literal["stop", "warn"] = "stop"

    def __post_init__(self) -> None:
        require(bool(self.dir.strip()), "dir must be a non-empty path")
        require(self.every_n_steps >= 0, f"every_n_steps must be >= 0 (0 = only at the end), got {self.every_n_steps}")
        require(self.keep_last >= 1,
                f"keep_last must be >= 1 because resuming needs at least one checkpoint, got {self.keep_last}")
        require(bool(self.resume.strip()), 'resume must be "auto", "never" or a checkpoint path')
        require(self.every_n_steps > 0 or self.save_at_end,
                "every_n_steps=0 and save_at_end=false would never save a checkpoint; enable one of them")
        require(self.hf_export_every >= 0,
                f"hf_export_every must be >= 0 (0 = only the final checkpoint), got {self.hf_export_every}")

    def exports_hf(self, step: int, final: bool) -> bool:
        """Whether the checkpoint of ``step`` (the run's last step when ``final``) gets an HF export."""
        every = self.hf_export_every
        return self.export_hf and (final or (every > 0 and step % every == 0))


class LoggingConfig(msgspec.Struct, kw_only=True):
    """Metrics logging, sample trajectories and plots.

    Attributes:
        dir: Directory for metrics.jsonl, samples/ (per-step sample dumps), TensorBoard events.
        jsonl: Append every step's metrics as one JSON line to dir/metrics.jsonl.
        tensorboard: "auto" logs to TensorBoard if the tensorboard package is installed, "on" requires
            it, "off" never.
        wandb: Log to Weights & Biases (needs the wandb package and a login).
        wandb_project: W&B project name.
        run_name: Run name for W&B and TensorBoard; none = a timestamp.
        print_every_n_steps: Print a one-line metrics summary every N steps; 0 = never.
        sample_trajectories: Trajectories per step written to dir/samples/step_N.jsonl (full text,
            rewards, tool calls, lineage) for inspection: the step's first ones; 0 = none.
        sample_trees: Prompts per step whose whole rollout tree (all k trajectories, with branch
            points, head entropies and branch decisions) goes to dir/samples/step_N.jsonl besides
            sample_trajectories: the step's first prompts; what ``python -m
            aepo_engine.experiments.trees`` draws. 0 = none.
        high_entropy_threshold: Entropy (nats) above which a response token counts as
            high-entropy in the per-step ``entropy/high_frac`` metric.
        plots_at_end: Draw reward/entropy/length curves from metrics.jsonl when training ends (needs
            matplotlib; skipped with a warning if missing).
    """

    dir: str = "logs"
    jsonl: bool = True
    tensorboard: Literal["auto", "on", "off"] = "auto"
    wandb: bool = False
    wandb_project: str = "aepo"
    run_name: str | None = None
    print_every_n_steps: int = 1
    sample_trajectories: int = 2
    sample_trees: int = 2
    high_entropy_threshold: float = 1.0
    plots_at_end: bool = True

    def __post_init__(self) -> None:
        require(bool(self.dir.strip()), "dir must be a non-empty path")
        require(not self.wandb or bool(self.wandb_project.strip()), "wandb=true needs a wandb_project")
        require(self.print_every_n_steps >= 0, f"print_every_n_steps must be >= 0, got {self.print_every_n_steps}")
        require(self.sample_trajectories >= 0, f"sample_trajectories must be >= 0, got {self.sample_trajectories}")
        require(self.sample_trees >= 0, f"sample_trees must be >= 0, got {self.sample_trees}")
        require(self.high_entropy_threshold >= 0, f"high_entropy_threshold must be >= 0 nats, got "
                f"{self.high_entropy_threshold}")

    def tensorboard_enabled(self) -> bool:
        """Resolve ``tensorboard`` against what is installed.

        Returns:
            Whether to write TensorBoard events.

        Raises:
            RuntimeError: tensorboard="on" but the package is missing.
        """
        installed = importlib.util.find_spec("tensorboard") is not None
        if self.tensorboard == "on" and not installed:
            raise RuntimeError("logging.tensorboard='on' but tensorboard is not installed: "
                               "pip install tensorboard, or set it to 'auto'")
        return self.tensorboard != "off" and installed


class SFTConfig(OptimConfig, forbid_unknown_fields=True, frozen=True):
    """Supervised warm-start settings: the optimizer fields of :class:`OptimConfig` (AdamW and
    its schedule, the same keys and checks) plus the warm start's own.

    The embedded preset (``presets/embedded.toml``) sets lr 2e-2 and the adaptive decay below,
    measured on its 4-layer, 128-wide tied-embedding Qwen3 (docs/experiments.md, "The warm start").

    The decay can wait for the skill: a tiny model learns to copy names and values (what the tool
    calls need) suddenly, at a step that varies several-fold with the initialisation and the batch
    order. With ``decay_steps`` > 0 the lr stays at its peak after warm-up and decays (cosine) over
    the last ``decay_steps`` steps; with ``decay_at_score`` it starts decaying as soon as the model
    reproduces that share of ``val_questions`` held-aside demonstrations, and the warm start ends
    ``decay_steps`` later: a seed that learns early stops early, a late one still gets its decay
    within ``steps``.

    Attributes:
        lr: peak AdamW learning rate; tiny freshly initialized models take large rates.
        betas: AdamW (beta1, beta2); beta2 0.95 for the short, noisy warm start.
        warmup_steps: linear warm-up from 0 to lr, in [0, steps].
        schedule: after warm-up: "cosine" decays to lr * min_lr_ratio by the last step, "constant" keeps lr.
        min_lr_ratio: the cosine decay ends at lr * min_lr_ratio.
        compute_dtype: "bfloat16" runs forward and backward under CPU/GPU autocast (the weights
            and optimizer stay float32): ~4x less CPU time per matmul where the CPU has AMX, many
            times more where it has neither AMX nor AVX512-BF16. "bfloat16_if_native": bfloat16
            where the device has it natively, float32 elsewhere (``aepo_engine.native_dtype``).
        steps: optimizer steps; with ``decay_at_score``, the most it may take.
        decay_steps: 0: ``schedule`` over all ``steps``; > 0 (``schedule = "cosine"``): constant lr
            after warm-up, then the cosine over the last ``decay_steps`` steps (or from when
            ``decay_at_score`` is reached).
        val_questions: train questions held aside from the demonstrations (synthetic task): their
            gold demonstrations score the warm start every ``score_every`` steps and at its end (the
            share the model writes token for token, greedy under teacher forcing:
            :func:`aepo_engine.sft.exact_match_share`). They remain RL prompts.
        score_every: steps between scores (with ``val_questions``).
        decay_at_score: with ``decay_steps``, start the decay once the score reaches this (0: decay
            at ``steps - decay_steps`` whatever the score).
        batch_size: sequences per step (padded to the longest in the batch).
        max_length: longer examples are rejected (truncation would cut off the answer).
        seed: fixes the example order; the model's init is the caller's. none = derived from the run's root seed (``aepo_engine.seeding``).
    """

    # The warm start's defaults where they differ from the RL run's optimizer (OptimConfig);
    # weight_decay, grad_clip and eps are OptimConfig's.
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = 0.1
    steps: int = 400
    decay_steps: int = 0
    val_questions: int = 0
    score_every: int = 25
    decay_at_score: float = 0.0
    batch_size: int = 16
    max_length: int = 512
    seed: int | None = None
    compute_dtype: Literal["float32", "bfloat16", "bfloat16_if_native"] = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.steps >= 1 and self.batch_size >= 1, "steps and batch_size must be >= 1")
        require(self.warmup_steps <= self.steps,
                "warmup_steps must lie in [0, steps] because the schedule decays after it")
        require(0 <= self.decay_steps <= self.steps - self.warmup_steps,
                f"decay_steps={self.decay_steps} must lie in [0, steps - warmup_steps] = "
                f"[0, {self.steps - self.warmup_steps}]: a shortened warm start shortens its decay too "
                f"(--task.warm_start.decay_steps=N, e.g. a fifth of steps)")
        require(self.decay_steps == 0 or self.schedule == "cosine",
                f'decay_steps > 0 is the cosine decay\'s length: it needs schedule = "cosine", not "{self.schedule}"')
        require(self.val_questions >= 0 and self.score_every >= 1,
                "val_questions must be >= 0 and score_every >= 1")
        require(0.0 <= self.decay_at_score <= 1.0, f"decay_at_score must lie in [0, 1], got {self.decay_at_score}")
        require(self.decay_at_score == 0.0 or (self.decay_steps > 0 and self.val_questions > 0),
                "decay_at_score needs decay_steps > 0 (the decay it starts) and val_questions > 0 (what it scores)")
