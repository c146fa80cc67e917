"""Evaluation throughput on CPU: questions per second and tool-call latency, HF vs vLLM-CPU backends.

Runs ``python -m aepo_engine.eval`` (a fresh process per repeat, ``--resume false``) with a tiny
Qwen3 trained for a few hundred steps on reference-format text, so that it writes ``<search>`` and
``<python>`` calls, against real tools: search over the offline cache of the reference data
(``../shared/data/arpo/search_cache.json``, BM25 fallback on a miss) and the python sandbox.
Per backend and repeat it records: questions per second of the generation loop (model load and
engine start excluded; from the command's summary.json), the wall time of the whole command,
the largest peak RSS of a process of the command's tree (``RUSAGE_CHILDREN`` in a wrapper process), and per benchmark the mean
calls per sample and mean latency per call of each tool. Rows go to ``bench/results/eval.jsonl``
with the machine, the commit and the load average; the table shows medians over repeats.

    python bench/bench_eval.py --backends hf vllm --data bamboogle aime24 gsm8k --questions 8 --k 2 --repeats 2

The tiny model's answers are noise: this measures the machinery, not accuracy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, write_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "arpo"
# Reference-format text with tool calls: what the tiny model is trained to imitate.
TEXTS = [
    "<think> I need to look this up. </think> <search> capital of France </search> <result> Page 1: Paris "
    "</result> <answer> The final answer is \\[ \\boxed{Paris} \\] </answer>",
    "<think> compute it </think> <python> print(17 * 23) </python> <result> 391 </result> <answer> "
    "The final answer is \\[ \\boxed{391} \\] </answer>",
    "<think> search first </think> <search> director of film Titanic </search> <result> Page 1: James Cameron "
    "</result> <python> print(1997 - 1954) </python> <result> 43 </result> <answer> \\boxed{43} </answer>",
]


QUESTIONS = ["Who was president of the United States in the year that Citibank was founded?",
             "Find the sum of all integer bases b > 9 for which 17_b is a divisor of 97_b.",
             "Janet's ducks lay 16 eggs per day. How much does she make every day?",
             "What rocket was the first spacecraft that ever approached Uranus launched on?"]


def build_model(work: Path) -> Path:
    """A tiny Qwen3 trained on chat-formatted questions answered with tool calls (see module doc)."""
    from aepo_engine.models import build_tiny_qwen3

    model = work / "tool_model"
    if not (model / "config.json").is_file():
        texts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{t}<|im_end|>"
                 for q in QUESTIONS for t in TEXTS]
        build_tiny_qwen3(model, texts=texts * 8, train_steps=300, seed=0, vocab_size=600)
    return model


# Runs the command in its own process so RUSAGE_CHILDREN covers this case only: the largest peak
# RSS of any process of its tree (the engine's workers included once they have exited).
_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print(f'maxrss_kib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr); "
            "sys.exit(rc)")


def run_once(model: Path, backend: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "aepo_engine.eval", "--model", str(model), "--backend", backend,
               "--data", *args.data, "--data-root", str(SHARED / "eval"), "--pass-k", str(args.k),
               "--max-questions", str(args.questions), "--out", str(out), "--resume=false",
               "--system-prompt=none", "--rollout.max_response_tokens=512", "--rollout.max_tokens_per_segment=64",
               "--tools.result_max_chars=500",
               "--tools.enabled=search,python", "--tools.search.backend=cache",
               f"--tools.search.cache_path={SHARED / 'search_cache.json'}", "--backend.max_model_len=2048"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *command], env=env, capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{backend}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    peak = int(proc.stderr.strip().splitlines()[-1].removeprefix("maxrss_kib=")) * 1024
    row = {"backend": backend, "questions_per_s": summary["questions_per_s"], "wall_s": wall,
           "generation_s": summary["seconds"], "peak_rss_bytes": peak, "load_avg_1m": os.getloadavg()[0]}
    for name, ds in summary["datasets"].items():
        for key, value in ds.items():
            if key.startswith(("calls/", "latency_s/")) or key == "response_tokens":
                row[f"{name}/{key}"] = value
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--data", nargs="+", default=["bamboogle", "aime24", "gsm8k"])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/aepo_bench_eval"))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work_dir)
    rows, medians = [], []
    for backend in args.backends:
        runs = [run_once(model, backend, args, args.work_dir / f"{backend}_{i}") for i in range(args.repeats)]
        rows += [{**r, "repeat": i, "data": args.data, "questions": args.questions, "k": args.k}
                 for i, r in enumerate(runs)]
        keys = {k for r in runs for k in r if isinstance(r[k], (int, float))}
        # a tool a repeat never called has no latency there: medians over the repeats that have the key
        medians.append({"backend": backend, **{k: statistics.median(r[k] for r in runs if k in r) for k in keys}})
    path = write_rows("eval", rows)
    latency_keys = sorted({k for m in medians for k in m if "/latency_s/" in k or "/calls/" in k})
    print_table(medians, ["backend", "questions_per_s", "generation_s", "wall_s", "peak_rss_bytes",
                          "load_avg_1m", *latency_keys])
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
