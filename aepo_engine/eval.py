"""``python -m aepo_engine.eval``: pass@k of a model on benchmarks, with the training rollout's tools.

    python -m aepo_engine.eval --model DIR --data gaia hle aime24 --pass-k 5 \\
        --data-root /data/arpo/eval --backend vllm --judge-url http://127.0.0.1:8001/v1

``--model`` is a Hugging Face model folder, a checkpoint (``step_XXXXXX/`` with ``hf_model/``) or a
run folder (``config.toml`` + ``checkpoints/``: its latest checkpoint, and its backend, rollout,
tools and eval settings as the base of this command's). With no arguments the command evaluates
the latest embedded-default run (``runs/aepo-default``) on its held-out set.

Options are the fields of :class:`EvalCommandConfig` (``-h`` lists them), from ``--config FILE``
(TOML/YAML/JSON) and ``--section.key=value`` overrides, plus the short names in ``ALIASES``
(``--data a b`` and ``--pass-k 1 5`` take several values). ``--dry-run`` prints the resolved config and
checks everything (model folder, data rows, the tools' back-ends and sandbox, the backend's
package, the judge endpoint) without generating; ``--list`` lists the benchmarks.

Output folder (``--out``): ``samples.jsonl`` (one record per sample: prompt, response, tool calls
with results and latencies, scores, judge verdict), ``summary.{md,csv,json}``, ``judge_cache.jsonl``
and ``run.json`` (the settings, checked on resume). Questions are generated in batches of
``questions_per_batch``; each batch is appended to ``samples.jsonl`` (fsync'd) once scored, so a
killed run restarted with the same command skips the questions already written. A batch's seeds
depend on its position only, so a resumed run produces the samples an uninterrupted one would.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import msgspec

from aepo_engine.checkpoint import HF_EXPORT, resume_candidates, verify_checkpoint
from aepo_engine.config_loader import (ConfigError, dump_config, format_help, load_config, merge_trees, pop_option,
                                      read_config_file, say_renamed)
from aepo_engine.errors import entry_point
from aepo_engine.evaluation.benchmarks import BENCHMARKS, EvalSet, eval_messages, load_eval_source
from aepo_engine.evaluation.config import SYSTEM_PROMPT_RENAMED, EvalConfig
from aepo_engine.evaluation.core import judge_records, sample_records
from aepo_engine.evaluation.judge import JudgeUnreachable, LLMJudge, start_judge
from aepo_engine.evaluation.report import format_table, provenance, summarize, write_reports
from aepo_engine.files import write_text_atomic
from aepo_engine.rewards.config import RULES_RENAMED
from aepo_engine.rollout.backends import BackendConfig
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.seeding import section_seed
from aepo_engine.tools.config import ToolsConfig

__all__ = ["ALIASES", "EvalCommandConfig", "expand_aliases", "load_eval_command", "main", "resolve_model"]

PROG = "python -m aepo_engine.eval"
SAMPLES_FILE = "samples.jsonl"


class EvalCommandConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The eval command: which model, where outputs go, and the sections it runs with.

    Attributes:
        model: a Hugging Face model folder, a checkpoint folder (with hf_model/) or a run folder
            (config.toml + checkpoints/); empty = the embedded-default run (runs/aepo-default).
        output_dir: folder for samples.jsonl and the summaries; empty = <run folder>/eval for a run,
            else runs/eval/<model folder name>.
        resume: continue the run in output_dir (finished questions are not redone); false starts over.
        questions_per_batch: questions generated together (their samples are one backend batch);
            the unit of resuming.
        eval: benchmarks, samples, pass@k, judge.
        backend: the generation backend (hf on CPU, vllm on GPU).
        rollout: the tool loop's limits (max_response_tokens, max_tool_calls, ...); branching is off.
        tools: the search and python tools.
        torch_threads: CPU threads of torch's intra-op pool (``torch.set_num_threads``); 0: torch's
            default, or with a run folder the run's ``train.torch_threads`` (a run sized for a
            shared CPU is evaluated the same way).
    """

    model: str = ""
    output_dir: str = ""
    resume: bool = True
    questions_per_batch: int = 8
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    backend: BackendConfig = msgspec.field(default_factory=BackendConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    tools: ToolsConfig = msgspec.field(default_factory=ToolsConfig)
    torch_threads: int = 0

    def __post_init__(self) -> None:
        if self.questions_per_batch < 1:
            raise ValueError(f"questions_per_batch must be >= 1, got {self.questions_per_batch}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0 (0 = torch's default), got {self.torch_threads}")


# Short command-line names -> config keys. "many" options take several space-separated values.
ALIASES: dict[str, str] = {
    "--data": "eval.files", "--data-root": "eval.data_root", "--pass-k": "eval.pass_k", "--samples": "eval.samples",
    "--temperature": "eval.temperature", "--top-p": "eval.top_p", "--max-questions": "eval.num_questions",
    "--system-prompt": "eval.system_prompt", "--judge-url": "eval.judge.url", "--judge-model": "eval.judge.model",
    "--out": "output_dir", "--output-dir": "output_dir", "--backend": "backend.kind",
    "--scoring": "eval.scoring", "--judge-prompt": "eval.judge.prompt",
    "--k": "eval.k",  # the old name of --pass-k: the loader says the new one (EvalConfig.RENAMED_KEYS)
}
_MANY = {"--data", "--pass-k", "--k"}


def expand_aliases(argv: Sequence[str]) -> list[str]:
    """Rewrite ``--data a b`` / ``--pass-k=5`` style short options into ``--eval.files=a,b`` overrides."""
    out, i, argv = [], 0, list(argv)
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in ALIASES:
            out.append(argv[i])
            i += 1
            continue
        values = [value] if eq else []
        i += 1
        while not eq and i < len(argv) and not argv[i].startswith("--") and (name in _MANY or not values):
            values.append(argv[i])
            i += 1
        if not values:
            raise ConfigError(f"{name} needs a value")
        out.append(f"--{ALIASES[name]}={','.join(values)}")
    return out


# --- the model -------------------------------------------------------------------------------------

@dataclass
class ModelSource:
    """What ``--model`` points at: the HF folder to load, and the training run around it if any."""

    model_dir: Path
    run_dir: Path | None = None
    train_config: Any = None


def _run_config(run_dir: Path) -> Any:
    from aepo_engine.config import TrainConfig
    from aepo_engine.config_loader import loads_config

    return loads_config(TrainConfig, (run_dir / "config.toml").read_text())


def resolve_model(spec: str) -> ModelSource:
    """Resolve ``--model`` (module docstring).

    Raises:
        ConfigError: nothing loadable there (the message says what was expected).
    """
    from aepo_engine.models.gguf import find_gguf, resolve_model_dir

    try:
        if find_gguf(spec) is not None:  # a GGUF file (or a folder with one): its converted HF folder
            return ModelSource(Path(resolve_model_dir(spec)))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {spec!r}: {exc}") from None
    path = Path(spec)
    if (path / "meta.json").is_file() and not (path / HF_EXPORT).is_dir():
        raise ConfigError(f"checkpoint {path} has no {HF_EXPORT}/ export: a run exports its final checkpoint "
                          "(and every checkpoint.hf_export_every steps); give that one, or the run folder")
    if (path / "config.toml").is_file() and not (path / "config.json").is_file() \
            and not (path / HF_EXPORT).is_dir():  # a checkpoint folder holds a config.toml too
        cfg = _run_config(path)
        return ModelSource(_newest_export(path / cfg.checkpoint.dir, path) / HF_EXPORT, path, cfg)
    if (path / HF_EXPORT / "config.json").is_file():
        path = path / HF_EXPORT
    if (path / "config.json").is_file():
        if path.name == HF_EXPORT:
            _check_export(path.parent)
        run = path.parent.parent.parent  # <run>/checkpoints/step_X/hf_model
        if path.name == HF_EXPORT and (run / "config.toml").is_file():
            return ModelSource(path, run, _run_config(run))
        return ModelSource(path)
    raise ConfigError(f"--model {spec!r}: expected a Hugging Face model folder (config.json), a checkpoint "
                      "folder (hf_model/), a training run folder (config.toml + checkpoints/) or a GGUF file")


def _check_export(checkpoint: Path) -> None:
    """Refuse a checkpoint's HF export whose files do not match the sizes and checksums its
    meta.json recorded (a damaged disk, a copy cut short)."""
    problems = verify_checkpoint(checkpoint, prefix=f"{HF_EXPORT}/")
    if problems:
        raise ConfigError(f"the HF export of {checkpoint} is damaged: {problems[0]}")


def _newest_export(root: Path, run: Path) -> Path:
    """The newest checkpoint under ``root`` with an intact HF export; a damaged one is skipped
    with a warning."""
    for checkpoint in resume_candidates(root):
        if not (checkpoint / HF_EXPORT / "config.json").is_file():
            continue
        problems = verify_checkpoint(checkpoint, prefix=f"{HF_EXPORT}/")
        if not problems:
            return checkpoint
        print(f"warning: the HF export of {checkpoint} is damaged ({problems[0]}): skipped", file=sys.stderr)
    raise ConfigError(f"run folder {run} has no checkpoint with an intact {HF_EXPORT}/ export under {root} "
                      "(a run exports its final checkpoint; train with checkpoint.export_hf = true)")


def _default_run_dir() -> Path:
    """The embedded default's run folder (the preset the trainer runs with no arguments)."""
    from aepo_engine.config import load_train_config

    return Path(load_train_config([]).run_dir)


# --- config ----------------------------------------------------------------------------------------

def load_eval_command(argv: Sequence[str]) -> tuple[EvalCommandConfig, ModelSource]:
    """The command's config and model: run settings (if the model is a run's) < --config files <
    overrides.

    Raises:
        ConfigError: bad options, or no model and no embedded-default run.
    """
    files, overrides = pop_option(expand_aliases(argv), "--config")
    raw: dict[str, Any] = {}
    for f in files:
        raw = merge_trees(raw, read_config_file(f))
    probe = load_config(EvalCommandConfig, data=raw, overrides=overrides)
    spec = probe.model
    if not spec:
        spec = str(_default_run_dir())
        if not (Path(spec) / "config.toml").is_file():
            raise ConfigError(f"no --model given and no embedded-default run in {spec}: train one with "
                              f"`python -m aepo_engine.train` (about 7 minutes on CPU), or pass --model DIR --data NAME")
    source = resolve_model(spec)
    base: dict[str, Any] = {"model": spec}
    if source.train_config is not None:
        run = source.train_config
        base |= {name: msgspec.to_builtins(getattr(run, name)) for name in ("backend", "rollout", "tools", "eval")}
        base["torch_threads"] = run.train.torch_threads
        # The run's held-out set is what its folder is evaluated on unless --data names others.
        base["eval"] = {k: v for k, v in base["eval"].items() if k not in ("every_n_steps", "files")}
    cfg = load_config(EvalCommandConfig, data=merge_trees(base, raw), overrides=overrides)
    return cfg, source


def output_dir(cfg: EvalCommandConfig, source: ModelSource) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    if source.run_dir is not None:
        return source.run_dir / "eval"
    return Path("runs") / "eval" / source.model_dir.name


# --- data ------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What a command evaluates."""

    sets: list[EvalSet]
    tools: ToolsConfig
    reward_fns: dict[str, Any] = field(default_factory=dict)  # dataset -> reward deciding `correct`


def build_plan(cfg: EvalCommandConfig, source: ModelSource) -> Plan:
    """Load the benchmarks (``eval.files``), or the run's own held-out set when none are given."""
    ev = cfg.eval
    if ev.files:
        try:
            sets = [load_eval_source(spec, ev.data_root, ev.num_questions) for spec in ev.files]
        except (ValueError, FileNotFoundError) as err:  # unknown name, missing file, no usable row
            raise ConfigError(str(err)) from None
        return Plan(sets, cfg.tools)
    if source.train_config is None:
        raise ConfigError(f"nothing to evaluate: give --data NAME|FILE (benchmarks: {', '.join(BENCHMARKS)})")
    from aepo_engine.rewards import build_reward_fn
    from aepo_engine.tasks import prepare_task

    run = source.train_config
    task = prepare_task(run.task, run.model, run.tools, run.data, source.run_dir,
                        setup_in_child=cfg.backend.kind == "vllm", log=lambda _: None)
    examples = task.eval_examples[: ev.num_questions or None]
    if not examples:
        raise ConfigError(f"run {source.run_dir} has no held-out set; give --data NAME|FILE")
    examples = [msgspec.structs.replace(e, data_source="heldout") for e in examples]
    heldout = EvalSet("heldout", examples, "qa", source=f"{source.run_dir} held-out set")
    return Plan([heldout], task.tools_config, {"heldout": build_reward_fn(run.reward)})


# --- resume ----------------------------------------------------------------------------------------

# Fingerprint keys added after output folders were first written, with the value those folders had
# (the project's rules, then called "engine").
_FINGERPRINT_SINCE = {"scoring": "engine", "judge_prompt": "engine"}
# Fingerprint keys whose values were renamed since (the project's rules were "engine", the authors'
# "reference"): an old folder's value is read under its new name, as the config loader reads an old config.
_FINGERPRINT_RENAMED = {"scoring": RULES_RENAMED, "judge_prompt": RULES_RENAMED, "system_prompt": SYSTEM_PROMPT_RENAMED}


def _fingerprint(cfg: EvalCommandConfig, source: ModelSource) -> dict[str, Any]:
    """Settings that change the records (samples, their scores, their verdicts): a resumed run must
    match them."""
    ev = cfg.eval
    return {"model": str(source.model_dir.resolve()), "samples": ev.n_samples, "temperature": ev.temperature,
            "top_p": ev.top_p, "seed": ev.seed, "system_prompt": ev.system_prompt,
            "questions_per_batch": cfg.questions_per_batch,
            "rollout": msgspec.to_builtins(cfg.rollout), "tools": sorted(cfg.tools.enabled),
            "scoring": ev.scoring, "judge_prompt": ev.judge.prompt}


def load_done(out: Path, n: int) -> list[dict[str, Any]]:
    """Records of the questions finished before (all n samples present); torn lines and partial
    questions are dropped, and the file is rewritten to hold exactly the kept records."""
    path = out / SAMPLES_FILE
    if not path.is_file():
        return []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the line a kill cut short
        if "references" in record and "ground_truth" not in record:  # written before the field's rename
            say_renamed(f"{path}: the samples' field 'references' is now called 'ground_truth'")
            record["ground_truth"] = record.pop("references")
        groups.setdefault((record["dataset"], record["question_index"]), []).append(record)
    kept = [r for group in groups.values() if sorted(s["sample"] for s in group) == list(range(n)) for r in group]
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    return kept


def _append(out: Path, records: list[dict[str, Any]]) -> None:
    with (out / SAMPLES_FILE).open("a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        handle.flush()
        os.fsync(handle.fileno())


def prepare_output(cfg: EvalCommandConfig, source: ModelSource, out: Path) -> list[dict[str, Any]]:
    """Create or reopen the output folder; return the records already done."""
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(cfg, source)
    run_file = out / "run.json"
    if not cfg.resume:
        (out / SAMPLES_FILE).unlink(missing_ok=True)
    elif run_file.is_file() and (out / SAMPLES_FILE).is_file():
        before = {**_FINGERPRINT_SINCE, **json.loads(run_file.read_text())}
        before.update({k: names.get(before.get(k), before.get(k)) for k, names in _FINGERPRINT_RENAMED.items()})
        changed = sorted(k for k in fingerprint.keys() | before.keys() if fingerprint.get(k) != before.get(k))
        if changed:
            raise ConfigError(f"{out} holds an evaluation with other settings ({', '.join(changed)} differ): "
                              "use another --out, or --resume false to start over")
    write_text_atomic(run_file, json.dumps(fingerprint, indent=2))
    return load_done(out, cfg.eval.n_samples)


# --- running ---------------------------------------------------------------------------------------

def _skipped_line(eval_set: EvalSet) -> str:
    rows = "; ".join(str(b) for b in eval_set.skipped[:5])
    more = f" (and {len(eval_set.skipped) - 5} more)" if len(eval_set.skipped) > 5 else ""
    return f"{eval_set.name}: skipped {len(eval_set.skipped)} rows: {rows}{more}"


def _print_skipped(sets: list[EvalSet]) -> None:
    for s in sets:
        if s.skipped:
            print(f"[data] {_skipped_line(s)}", file=sys.stderr)


def run(cfg: EvalCommandConfig, source: ModelSource) -> dict[str, Any]:
    """Generate, score, judge and report; returns the summary (also written to the output folder)."""
    from aepo_engine.metrics import ProgressBar
    from aepo_engine.tools.formats import build_tool_format
    from aepo_engine.rollout.backends import build_backend
    from aepo_engine.tools import ToolRunner, build_tools
    from transformers import AutoTokenizer

    from aepo_engine.config import apply_torch_threads

    apply_torch_threads(cfg.torch_threads)  # before the backend and the task set-up are built
    out = output_dir(cfg, source)
    plan = build_plan(cfg, source)
    _print_skipped(plan.sets)
    records = prepare_output(cfg, source, out)
    done = {(r["dataset"], r["question_index"]) for r in records}
    total = sum(len(s.examples) for s in plan.sets)
    print(f"[eval] {source.model_dir}: {', '.join(f'{s.name} ({len(s.examples)})' for s in plan.sets)}; "
          f"{cfg.eval.n_samples} samples per question; {len(done)} questions already done; output {out}",
          flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.model_dir)
    tool_format = build_tool_format(plan.tools.format, tokenizer, plan.tools.enabled)
    # The backend first: a vLLM engine must start before the search index loads numba.
    backend = build_backend(cfg.backend, str(source.model_dir), tokenizer, seed=section_seed(cfg.eval.seed, "eval.seed"))
    judge, judge_error = start_judge(cfg.eval.judge, out / "judge_cache.jsonl",
                                     warn=lambda line: print(line, file=sys.stderr))
    judge_info = None if judge is None else {"model": judge.model, "prompt": cfg.eval.judge.prompt, "url": judge.base}
    print(f"[eval] {provenance({'scoring': cfg.eval.scoring, 'judge': judge_info})}", flush=True)
    bar = ProgressBar(total, start=len(done), unit="questions")
    t0, generated, tokens = time.perf_counter(), 0, 0
    with ToolRunner(build_tools(plan.tools), max_workers=plan.tools.max_workers) as tools:
        for eval_set in plan.sets:
            for start in range(0, len(eval_set.examples), cfg.questions_per_batch):
                batch = eval_set.examples[start:start + cfg.questions_per_batch]
                if all((eval_set.name, e.index) in done for e in batch):
                    continue
                prompts = [tool_format.encode_prompt(eval_messages(e, cfg.eval.system_prompt)) for e in batch]
                new = sample_records(backend, tools, tokenizer, cfg.rollout, cfg.eval, prompts, batch, eval_set.check,
                                     reward_fn=plan.reward_fns.get(eval_set.name),
                                     step=start // cfg.questions_per_batch, tool_format=tool_format,
                                     progress=f"{eval_set.name} batch {start // cfg.questions_per_batch + 1}")
                new = [r for r in new if (r["dataset"], r["question_index"]) not in done]
                if judge is not None:
                    judge_records(new, judge)
                _append(out, new)
                records += new
                done |= {(r["dataset"], r["question_index"]) for r in new}
                generated += len({r["question_index"] for r in new})
                tokens += sum(r["total_tokens"] for r in new)
                bar.update(len(done) - 1, {"pass@1": sum(r["correct"] for r in records) / len(records),
                                           "tok/s": tokens / max(time.perf_counter() - t0, 1e-9)})
    bar.close()
    seconds = time.perf_counter() - t0
    summary = summarize(records, cfg.eval.pass_ks)
    print(format_table(summary), flush=True)
    extra = {"model": str(source.model_dir), "output_dir": str(out), "scoring": cfg.eval.scoring, "judge": judge_info,
             "questions_generated": generated,
             "seconds": seconds, "questions_per_s": generated / seconds if seconds else 0.0,
             "judge_error": judge_error,
             "skipped_rows": {s.name: [str(b) for b in s.skipped] for s in plan.sets if s.skipped}}
    write_reports(summary, out, extra)
    print(f"[eval] wrote {out / SAMPLES_FILE} and {out}/summary.{{md,csv,json}}", flush=True)
    return {"datasets": summary, **extra}


def _dry_run(cfg: EvalCommandConfig, source: ModelSource) -> int:
    """Check what the command would use without generating: the model folder, the data (rows kept
    and skipped), the tools it runs (the trainer's dry-run checks), the backend's package and the
    judge. Prints the resolved config (stdout) and the findings (stderr); returns 0 or 2."""
    from aepo_engine.dry_run import DryRunReport, check_backend, check_model_dir, check_tools
    from aepo_engine.tools import tool_problems

    report = DryRunReport()
    report.notes.append(f"model {source.model_dir}" + (f" (run {source.run_dir})" if source.run_dir else ""))
    check_model_dir(source.model_dir, report, field="--model")
    try:
        plan = build_plan(cfg, source)
    except ConfigError as err:
        report.problems.append(str(err))
    else:
        for s in plan.sets:
            report.notes.append(f"{s.name}: {len(s.examples)} questions from {s.source}, {len(s.skipped)} rows "
                                f"skipped, answers checked as {s.check} under {cfg.eval.scoring} scoring")
            if s.skipped:
                report.notes.append(_skipped_line(s))
        report.problems += tool_problems(plan.tools)  # tools.path, tools.enabled, tools.options
        check_tools(plan.tools, report)
    check_backend(cfg.backend, report)
    if cfg.eval.judge.url:
        try:
            report.notes.append(f"judge {cfg.eval.judge.url}: model {LLMJudge(cfg.eval.judge, os.devnull).check()}")
        except JudgeUnreachable as err:
            report.problems.append(str(err))
    report.notes.append(f"output folder {output_dir(cfg, source)}")
    sys.stdout.write(dump_config(cfg))
    sys.stdout.flush()
    return report.write(sys.stderr)


def list_benchmarks(data_root: str) -> str:
    if not data_root:
        return ("eval.data_root is not set: pass --data-root DIR to see which benchmark files are found\n"
                + "\n".join(f"{b.name:10s} {b.check:5s} DIR/{b.path}" for b in BENCHMARKS.values()))
    lines = []
    for bench in BENCHMARKS.values():
        present = "found" if (Path(data_root) / bench.path).is_file() else "missing"
        lines.append(f"{bench.name:10s} {bench.check:5s} {Path(data_root) / bench.path} ({present})")
    return "\n".join(lines)


@entry_point
def main(argv: list[str]) -> dict[str, Any] | None:
    """The command (module docstring); exit status 2 on bad input or an unavailable part, with one
    ``error:`` line (:mod:`aepo_engine.errors`), 3 when the judge was asked for but unreachable
    (the other scores are written)."""
    flags = {a for a in argv if a in ("--dry-run", "--list", "-h", "--help")}
    argv = [a for a in argv if a not in flags]
    if flags & {"-h", "--help"}:
        aliases = ", ".join(f"{k} -> --{v}" for k, v in ALIASES.items() if k != "--k")
        print(format_help(EvalCommandConfig, PROG, usage="[--model DIR] [--data NAME|FILE ...] [--pass-k K ...] "
                          "[--config FILE ...] [--section.key=value ...] [--dry-run] [--list] [--debug]")
              + f"\n\nshort options: {aliases}")
        return None
    if "--list" in flags:
        files, overrides = pop_option(expand_aliases(argv), "--config")
        print(list_benchmarks(load_config(EvalCommandConfig, path=files, overrides=overrides).eval.data_root))
        return None
    cfg, source = load_eval_command(argv)
    if "--dry-run" in flags:
        raise SystemExit(_dry_run(cfg, source))
    result = run(cfg, source)
    if result["judge_error"]:
        raise SystemExit(3)
    return result


if __name__ == "__main__":
    main()
