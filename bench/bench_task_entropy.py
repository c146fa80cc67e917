"""Where a synthetic-task run's warm-started policy is uncertain: next-token entropy at the heads
of the segments that follow tool results, against the first segment and all model-written tokens.

    python bench/bench_task_entropy.py RUN_DIR [RUN_DIR ...] [--questions 200] [--model final] [--write]

For each run directory of a ``task.source = "synthetic"`` run (its ``config.toml`` and
``setup/``), rebuilds the task, writes the *gold* demonstration of each held-out question with
the run's real tools (BM25 over the run's corpus, the python sandbox), and scores it
teacher-forced with the warm-started model (``setup/warm_start``; ``--model final``: the latest
RL checkpoint's ``hf_model``). Per question: the mean entropy
over the first ``rollout.n_entropy_tokens`` model-written tokens of the first segment (before any
tool call; the "search or guess" decision) and of every segment after a tool result (what AEPO's
branching measures), and the largest single-token entropy in those post-tool heads (the decision
token, e.g. the namesake's surname); for namesake questions also the probability the model gives
the right namesake among the listed ones (each surname scored as the continuation of the second
query). Teacher forcing on gold text is not the on-policy rollout
entropy the trainer logs (``rollout/entropy_mean``): it asks how unsure the policy is at the
right continuation, identically for every task. One JSON row per run to stdout, and with
``--write`` to ``bench/results/task_entropy.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from aepo_engine.provenance import git_commit

RESULTS = Path(__file__).resolve().parent / "results" / "task_entropy.jsonl"


def token_entropies(model, input_ids: list[int]) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution that predicts each token: [T] (0 at t=0)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # entropy[t] is the distribution of token t + 1
    return torch.cat([torch.zeros(1), entropy[:-1]])


def segment_heads(loss_mask: tuple[int, ...], n_tokens: int) -> list[list[int]]:
    """Positions of the first ``n_tokens`` model-written tokens of each model-written segment."""
    heads: list[list[int]] = []
    previous = 0
    for position, written in enumerate(loss_mask):
        if written and not previous:
            heads.append([])
        if written and len(heads[-1]) < n_tokens:
            heads[-1].append(position)
        previous = written
    return heads


def candidate_logprob(model, tokenizer, question, prefix_text: str, continuation: str) -> float:
    """log p(continuation | prompt + prefix_text) under the model, tokenized as the warm start
    tokenizes responses (``tokenize_example``: tool results apart, end-of-turn token dropped)."""
    from aepo_engine.sft import tokenize_example

    prefix = list(tokenize_example(tokenizer, question.messages(), prefix_text).input_ids[:-1])
    full = list(tokenize_example(tokenizer, question.messages(), prefix_text + continuation).input_ids[:-1])
    if full[:len(prefix)] != prefix:
        raise ValueError(f"{continuation!r} does not tokenize as a continuation of the prefix")
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0].float(), dim=-1)  # [T, V]
    return sum(logp[t - 1, full[t]].item() for t in range(len(prefix), len(full)))


def namesake_pick(model, tokenizer, question, demo: str) -> tuple[float, bool]:
    """The model's probability of the right namesake, normalized over the listed ones (the
    first surname the response writes after the first result, each candidate scored as a
    continuation), and whether the right one is the most likely."""
    from aepo_engine.tasks.synthetic import namesake_candidates

    first, key = question.plan[0].payload.split()
    right = question.plan[1].payload.split()[1]
    cut = demo.index("</result>") + len("</result>")
    listing = demo[demo.index("<result>\n") + len("<result>\n"):cut - len("\n</result>")]
    surnames = [surname for surname, _ in namesake_candidates(listing, first, key)]
    # The first time the response writes the surname after the listing: in the second query
    # ("<search> Zorva Tika") or, with task.synthetic.namesake_note, in the note ("<think> Tarunu Tika").
    prefix = demo[:cut + demo[cut:].index(f" {right}")]
    scores = torch.tensor([candidate_logprob(model, tokenizer, question, prefix, f" {s}") for s in surnames])
    probs, index = torch.softmax(scores, dim=0), surnames.index(right)
    return probs[index].item(), bool(probs.argmax() == index)


def model_dir_of(run_dir: Path, which: str) -> Path:
    """``setup/warm_start`` or the latest RL checkpoint's ``hf_model``."""
    if which == "warm_start":
        return run_dir / "setup" / "warm_start"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return run_dir / "checkpoints" / latest / "hf_model"


def measure(run_dir: Path, num_questions: int, which: str = "warm_start") -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aepo_engine.config import TrainConfig
    from aepo_engine.config_loader import load_config
    from aepo_engine.tasks.synthetic_setup import synthetic_tools_config, tool_fn_from_runner
    from aepo_engine.sft import tokenize_example
    from aepo_engine.tasks.synthetic import make_demonstrations, make_task
    from aepo_engine.tools import ToolRunner, build_tools

    cfg = load_config(TrainConfig, path=[str(run_dir / "config.toml")])
    task = make_task(cfg.task.synthetic)
    questions = task.heldout[:num_questions]
    tools = synthetic_tools_config(cfg.tools, run_dir / "setup" / "corpus.jsonl")
    with ToolRunner(build_tools(tools), max_workers=tools.max_workers) as runner:
        demos = make_demonstrations(questions, tool_fn_from_runner(runner))
    model_dir = model_dir_of(run_dir, which)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_tokens = cfg.rollout.n_entropy_tokens
    first, post_tool, post_tool_max, written, picks = [], [], [], [], []
    for question, demo in zip(questions, demos):
        if question.kind == "namesake":
            picks.append(namesake_pick(model, tokenizer, question, demo))
        example = tokenize_example(tokenizer, question.messages(), demo)
        entropy = token_entropies(model, list(example.input_ids))
        heads = segment_heads(example.loss_mask, n_tokens)
        written.append(entropy[torch.tensor(example.loss_mask, dtype=torch.bool)].mean().item())
        first.append(entropy[heads[0]].mean().item())
        for head in heads[1:]:
            post_tool.append(entropy[head].mean().item())
            post_tool_max.append(entropy[head].max().item())
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    synthetic = cfg.task.synthetic
    return {"run_dir": str(run_dir), "model": str(model_dir.relative_to(run_dir)), "questions": len(questions), "n_entropy_tokens": n_tokens,
            "kinds": sorted({q.kind for q in questions}), "demo_guess_rate": synthetic.demo_guess_rate,
            "demo_wrong_pick_rate": synthetic.demo_wrong_pick_rate,
            "entropy_written_mean": mean(written), "entropy_first_head_mean": mean(first),
            "entropy_post_tool_head_mean": mean(post_tool), "entropy_post_tool_head_max_mean": mean(post_tool_max),
            "post_tool_segments": len(post_tool),
            # namesake questions: the model's probability of the right namesake among the listed
            # ones (1 / namesakes_per_group = no matching), and how often it is the most likely
            "namesake_p_right_mean": mean([p for p, _ in picks]),
            "namesake_right_is_argmax": mean([float(top) for _, top in picks])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--questions", type=int, default=200, help="held-out questions per run")
    parser.add_argument("--model", choices=("warm_start", "final"), default="warm_start",
                        help="the warm-started model or the latest RL checkpoint's")
    parser.add_argument("--write", action="store_true", help=f"append the rows to {RESULTS}")
    args = parser.parse_args()
    commit = git_commit(__file__)
    for run_dir in args.run_dirs:
        t0 = time.perf_counter()
        row = measure(run_dir, args.questions, args.model)
        row |= {"seconds": round(time.perf_counter() - t0, 1), "commit": commit, "machine": platform.node(),
                "load_avg_1m": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
        print(json.dumps(row), flush=True)
        if args.write:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
