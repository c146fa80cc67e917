"""The ``data`` section: where the training and evaluation data is and how rows become examples."""
from __future__ import annotations

from typing import Literal

import msgspec

from aepo_engine.errors import require


HF_PREFIX = "hf:"
# The formats read without a reader of the user's own (``data.readers``).
BUILT_IN_FORMATS = ("parquet", "jsonl", "json", "hf")


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
        format: Source format: "auto" picks it from the suffix (.parquet, .jsonl, .json, or one a reader
            of reader_path registered) or the hf: prefix; "parquet", "jsonl", "json", "hf", or the
            name of a reader that reader_path registers.
        reader_path: a dataset reader of your own outside the package: a .py file (absolute or relative
            to the working directory) or an importable module, imported before the first source is
            read; its ``@register_reader("name", suffixes=(".csv",))`` functions (``aepo_engine.data.readers``:
            spec -> iterable of row dicts) join the formats; empty = the built-in formats only.
        prompt_key: Column holding a chat prompt (list of {role, content}); rows without it are built
            from the question by the prompt template.
        question_keys: Keys tried in order for the question text; dotted keys reach into nested columns
            (extra_info.question in the reference parquet files).
        answer_keys: Keys tried in order for the ground truth: a string, a list of strings (e.g.
            golden_answers) or a JSON-encoded list; numbers are turned into strings.
        max_prompt_tokens: Longest chat prompt in tokens (with the model's chat template), checked
            for train and eval prompts when the run starts; never truncated, since a cut question can
            have a different answer (see overlong_prompts).
        overlong_prompts: A prompt over max_prompt_tokens: "drop" skips it with a count in the log,
            "error" refuses to start.
        bad_rows: What to do with a malformed row (missing fields, wrong types, empty question,
            unparseable JSON line): "skip" warns with counts per file, "error" stops at the first one.
        shuffle: Shuffle the training prompts each epoch.
        shuffle_seed: Seed of the per-epoch permutation; the sampler's state stores it, so a resumed run
            continues with the same order; none = derived from the run's root seed (``aepo_engine.seeding``).
        max_examples: Use only the first N examples of each source (for debugging); none = all.
    """

    train_files: list[str] = []
    eval_files: list[str] = []
    format: str = "auto"
    reader_path: str = ""
    prompt_key: str = "prompt"
    question_keys: list[str] = msgspec.field(
        default_factory=lambda: ["extra_info.question", "question", "Question", "problem"])
    answer_keys: list[str] = msgspec.field(
        default_factory=lambda: ["reward_model.ground_truth", "answer", "golden_answers"])
    max_prompt_tokens: int = 2000
    overlong_prompts: Literal["drop", "error"] = "drop"
    bad_rows: Literal["skip", "error"] = "skip"
    shuffle: bool = True
    shuffle_seed: int | None = None
    max_examples: int | None = None

    def __post_init__(self) -> None:
        sources = self.train_files + self.eval_files
        require(all(s.strip() for s in sources), "data sources must be non-empty strings")
        dupes = sorted({s for s in self.train_files if self.train_files.count(s) > 1})
        require(not dupes, f"train_files lists {dupes} twice, which would double their weight silently")
        for spec in sources:
            if spec.startswith(HF_PREFIX):
                parse_hf_spec(spec)
        require(self.format in ("auto", *BUILT_IN_FORMATS) or bool(self.reader_path),
                f"format={self.format!r} is no built-in format (auto, {', '.join(BUILT_IN_FORMATS)}); a reader of "
                "your own is named by its module in reader_path")
        if self.format == "hf":
            bad = [s for s in sources if not s.startswith(HF_PREFIX)]
            require(not bad, f"format='hf' but {bad} lack the hf: prefix; use format='auto' to mix")
        require(self.question_keys != [], "question_keys must name at least one key")
        require(self.answer_keys != [], "answer_keys must name at least one key")
        require(self.max_prompt_tokens > 0, f"max_prompt_tokens must be > 0, got {self.max_prompt_tokens}")
        require(self.max_examples is None or self.max_examples > 0,
                 f"max_examples must be > 0 (or none for all), got {self.max_examples}")
