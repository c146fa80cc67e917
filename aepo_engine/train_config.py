"""Config sections for data, optimizer, checkpointing and logging.

Each section is a ``msgspec.Struct`` with one default per field (the single source of truth), help in its
docstring's ``Attributes:`` block (read by ``config_loader`` for ``--help`` and TOML comments) and a
``__post_init__`` that rejects bad values and says why. Defaults follow AEPO_SPEC.md §3 (the reference
Qwen3-14B run). The sections hold settings only; the code that acts on them lives in ``data.py``,
``checkpoint.py`` and the trainer.

Fields that may be unset are ``X | None = None``: TOML has no null, so an Optional field must default to
None for a dumped config to load back equal.
"""
from __future__ import annotations

import importlib.util
from typing import Literal

import msgspec

__all__ = ["CheckpointConfig", "DataConfig", "LoggingConfig", "OptimConfig", "parse_hf_spec"]


def _require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ``ok``; msgspec reports it with the section's path."""
    if not ok:
        raise ValueError(message)


# --- data -----------------------------------------------------------------------------------------

HF_PREFIX = "hf:"


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """Split ``hf:NAME[:SPLIT]`` or ``hf:NAME:CONFIG:SPLIT`` into (name, config, split).

    Args:
        spec: a data source string starting with ``hf:``.

    Returns:
        (dataset name, config name or None, split; "train" when omitted).
    """
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise ValueError(
            f"bad Hugging Face dataset spec {spec!r}: use hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT"
        )
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else "train"


class DataConfig(msgspec.Struct, kw_only=True):
    """Training and evaluation data: where it is and how rows become examples.

    Attributes:
        train_files: Training data sources: .parquet files in the reference (verl/ARPO) format, .jsonl /
            .json question-answer files, or Hugging Face datasets as hf:NAME[:SPLIT] or
            hf:NAME:CONFIG:SPLIT (needs the `datasets` package). Empty: no training data (set it).
        eval_files: Evaluation data sources, same forms as train_files.
        format: Source format; "auto" picks it from the suffix (.parquet, .jsonl, .json) or the hf: prefix.
        prompt_key: Column holding a chat prompt (list of {role, content}); rows without it are built
            from the question by the prompt template.
        question_keys: Keys tried in order for the question text; dotted keys reach into nested columns
            (extra_info.question in the reference parquet files).
        answer_keys: Keys tried in order for the ground truth: a string, a list of strings (e.g.
            golden_answers) or a JSON-encoded list; numbers are turned into strings.
        max_prompt_tokens: Prompts longer than this many tokens are dropped (with a count in the log)
            rather than truncated, since a cut question can have a different answer.
        bad_rows: What to do with a malformed row (missing fields, wrong types, empty question,
            unparseable JSON line): "skip" warns with counts per file, "error" stops at the first one.
        shuffle: Shuffle the training prompts each epoch.
        shuffle_seed: Seed of the per-epoch permutation; the sampler's state stores it, so a resumed run
            continues with the same order.
        max_examples: Use only the first N examples of each source (for debugging); none = all.
    """

    train_files: list[str] = []
    eval_files: list[str] = []
    format: Literal["auto", "parquet", "jsonl", "json", "hf"] = "auto"
    prompt_key: str = "prompt"
    question_keys: list[str] = msgspec.field(
        default_factory=lambda: ["extra_info.question", "question", "Question", "problem"])
    answer_keys: list[str] = msgspec.field(
        default_factory=lambda: ["reward_model.ground_truth", "answer", "golden_answers"])
    max_prompt_tokens: int = 2000
    bad_rows: Literal["skip", "error"] = "skip"
    shuffle: bool = True
    shuffle_seed: int = 0
    max_examples: int | None = None

    def __post_init__(self) -> None:
        sources = self.train_files + self.eval_files
        _require(all(s.strip() for s in sources), "data sources must be non-empty strings")
        dupes = sorted({s for s in self.train_files if self.train_files.count(s) > 1})
        _require(not dupes, f"train_files lists {dupes} twice, which would double their weight silently")
        for spec in sources:
            if spec.startswith(HF_PREFIX):
                parse_hf_spec(spec)
        if self.format == "hf":
            bad = [s for s in sources if not s.startswith(HF_PREFIX)]
            _require(not bad, f"format='hf' but {bad} lack the hf: prefix; use format='auto' to mix")
        _require(self.question_keys != [], "question_keys must name at least one key")
        _require(self.answer_keys != [], "answer_keys must name at least one key")
        _require(self.max_prompt_tokens > 0, f"max_prompt_tokens must be > 0, got {self.max_prompt_tokens}")
        _require(self.max_examples is None or self.max_examples > 0,
                 f"max_examples must be > 0 (or none for all), got {self.max_examples}")


# --- optimizer ------------------------------------------------------------------------------------

class OptimConfig(msgspec.Struct, kw_only=True):
    """AdamW optimizer and learning-rate schedule.

    Attributes:
        lr: Peak learning rate (reference runs: 1e-6, constant).
        weight_decay: Decoupled (AdamW) weight decay.
        grad_clip: Clip the global gradient norm to this value; 0 turns clipping off.
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        warmup_steps: Linear warm-up from 0 to lr over this many optimizer steps; 0 = no warm-up.
        schedule: After warm-up: "constant" keeps lr, "cosine" decays to min_lr_ratio * lr by the last step.
        min_lr_ratio: Final lr as a fraction of lr for the cosine schedule.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        _require(all(0 <= b < 1 for b in self.betas),
                 f"betas must lie in [0, 1) because AdamW divides by 1 - beta**t, got {self.betas}")
        _require(self.eps > 0, f"eps must be > 0 because AdamW divides by sqrt(v) + eps, got {self.eps}")
        _require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        _require(self.schedule == "cosine" or self.min_lr_ratio == 0,
                 "min_lr_ratio only applies to schedule='cosine'; set schedule='cosine' or leave it at 0")


# --- checkpoints ----------------------------------------------------------------------------------

class CheckpointConfig(msgspec.Struct, kw_only=True):
    """Checkpoint saving and resuming.

    Attributes:
        dir: Directory holding step_XXXXXX/ checkpoints and the `latest` marker.
        every_n_steps: Save every N optimizer steps; 0 = only at the end of training.
        keep_last: Keep this many most recent checkpoints (the one `latest` names is never deleted).
        resume: "auto" resumes from the latest checkpoint in dir if there is one, "never" starts fresh,
            any other value is the path of a step_XXXXXX directory to resume from.
        save_at_end: Save a final checkpoint when training finishes.
        export_hf: Also write each checkpoint's model as a Hugging Face directory (safetensors, config,
            tokenizer) loadable with from_pretrained; the training state is saved either way.
    """

    dir: str = "checkpoints"
    every_n_steps: int = 50
    keep_last: int = 3
    resume: str = "auto"
    save_at_end: bool = True
    export_hf: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.dir.strip()), "dir must be a non-empty path")
        _require(self.every_n_steps >= 0, f"every_n_steps must be >= 0 (0 = only at the end), got {self.every_n_steps}")
        _require(self.keep_last >= 1,
                 f"keep_last must be >= 1 because resuming needs at least one checkpoint, got {self.keep_last}")
        _require(bool(self.resume.strip()), 'resume must be "auto", "never" or a checkpoint path')
        _require(self.every_n_steps > 0 or self.save_at_end,
                 "every_n_steps=0 and save_at_end=false would never save a checkpoint; enable one of them")


# --- logging --------------------------------------------------------------------------------------

class LoggingConfig(msgspec.Struct, kw_only=True):
    """Metrics logging, sample trajectories and plots.

    Attributes:
        dir: Directory for metrics.jsonl, samples.jsonl, TensorBoard events and plots.
        jsonl: Append every step's metrics as one JSON line to dir/metrics.jsonl.
        tensorboard: "auto" logs to TensorBoard if the tensorboard package is installed, "on" requires
            it, "off" never.
        wandb: Log to Weights & Biases (needs the wandb package and a login).
        wandb_project: W&B project name.
        run_name: Run name for W&B and TensorBoard; none = a timestamp.
        print_every_n_steps: Print a one-line metrics summary every N steps; 0 = never.
        sample_trajectories: Trajectories per step written to dir/samples.jsonl (full text, rewards,
            tool calls) for inspection; 0 = none.
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
    plots_at_end: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.dir.strip()), "dir must be a non-empty path")
        _require(not self.wandb or bool(self.wandb_project.strip()), "wandb=true needs a wandb_project")
        _require(self.print_every_n_steps >= 0, f"print_every_n_steps must be >= 0, got {self.print_every_n_steps}")
        _require(self.sample_trajectories >= 0, f"sample_trajectories must be >= 0, got {self.sample_trajectories}")

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
