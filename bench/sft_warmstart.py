"""How far a short supervised warm-start takes a tiny Qwen3 on the synthetic tool-use task.

Builds the task, writes demonstrations with real tool results, builds a tiny Qwen3 + BPE tokenizer
(``aepo_engine.models.build_tiny_qwen3``), runs ``aepo_engine.sft.train_sft`` and evaluates
held-out questions with a minimal multi-round tool loop (generate until ``</search>`` /
``</python>`` / end of turn, run the tool, append `` <result>\\n...\\n</result>``, continue) at
given checkpoints, greedy and at temperature 1. Rows go to a JSON file.

    python bench/sft_warmstart.py --seeds 0 1 2 --steps 300 --eval-at 100 200 300

Search: ``--search exact`` (top-1 exact-name lookup rendered as ``Page 1: ...``) or
``--search bm25`` (the engine's BM25 ``CorpusBackend`` with ``--topk`` pages). Python: an
arithmetic-only evaluator (``safe_print_eval``), which is all the task needs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aepo_engine.models import build_tiny_qwen3
from aepo_engine.tools.parsing import format_tool_result
from aepo_engine.sft import SFTConfig, SFTExample, build_examples, collate, train_sft
from aepo_engine.tasks.synthetic import (SYSTEM_PROMPT, SyntheticTaskConfig,
                                         is_correct, make_demonstrations, make_task,
                                         reference_tool_fn, safe_print_eval)


def make_tool_fn(task, kind: str, topk: int, workdir: str):
    if kind == "exact":
        return reference_tool_fn(task)
    from aepo_engine.tools.search import CorpusBackend
    backend = CorpusBackend.from_jsonl(task.write_corpus(os.path.join(workdir, "kb.jsonl")), topk=topk)
    return lambda tool, payload: backend.search(payload) if tool == "search" else safe_print_eval(payload)


# ---------------------------------------------------------------------------------------------
# Evaluation: a minimal multi-round tool loop over HF generate


@torch.no_grad()
def rollout(model, tokenizer, questions, tool_fn, temperature: float, seed: int,
            max_tool_calls: int = 6, max_new_tokens: int = 48, batch_size: int = 100,
            with_tokens: bool = False):
    """Responses (text with tool results) for every question; with ``with_tokens`` also
    ``SFTExample``s (prompt + response ids, mask 1 on sampled tokens) for a policy update."""
    stop_ids = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(["</search>", "</python>"])
    responses, trajectories = [], []
    for start in range(0, len(questions), batch_size):
        chunk = questions[start:start + batch_size]
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(q.messages(), add_generation_prompt=True,
                                                                   tokenize=False), add_special_tokens=False)
                   for q in chunk]
        contexts = [list(p) for p in prompts]
        masks = [[0] * len(p) for p in prompts]
        active = list(range(len(chunk)))
        calls = [0] * len(chunk)
        for round_index in range(max_tool_calls + 1):
            if not active:
                break
            width = max(len(contexts[i]) for i in active)
            input_ids = torch.full((len(active), width), tokenizer.pad_token_id)
            attention = torch.zeros((len(active), width), dtype=torch.long)
            for row, i in enumerate(active):  # left padding
                input_ids[row, width - len(contexts[i]):] = torch.tensor(contexts[i])
                attention[row, width - len(contexts[i]):] = 1
            torch.manual_seed(seed * 1000 + round_index)
            sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
                else dict(do_sample=False)
            out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                 eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, **sample)
            still = []
            for row, i in enumerate(active):
                new = out[row, width:].tolist()
                cut = next((k + 1 for k, t in enumerate(new) if t in stop_ids), len(new))
                new = new[:cut]
                contexts[i] += new
                masks[i] += [1] * len(new)
                if not new or new[-1] not in stop_ids[1:] or calls[i] >= max_tool_calls:
                    continue
                text = tokenizer.decode(new)
                tool = "search" if new[-1] == stop_ids[1] else "python"
                opening = text.rfind(f"<{tool}>")
                if opening < 0:
                    continue  # malformed call ends the trajectory
                payload = text[opening + len(tool) + 2:text.rfind(f"</{tool}>")]
                result = format_tool_result(tool_fn(tool, payload))
                result_ids = tokenizer.encode(result, add_special_tokens=False)
                contexts[i] += result_ids
                masks[i] += [0] * len(result_ids)
                calls[i] += 1
                still.append(i)
            active = still
        for i, q in enumerate(chunk):
            responses.append(tokenizer.decode(contexts[i][len(prompts[i]):], skip_special_tokens=True))
            trajectories.append(SFTExample(tuple(contexts[i]), tuple(masks[i])))
    return (responses, trajectories) if with_tokens else responses


def evaluate(model, tokenizer, questions, tool_fn, temperature: float, seed: int) -> dict:
    start = time.perf_counter()
    responses = rollout(model, tokenizer, questions, tool_fn, temperature, seed)
    by_kind = defaultdict(list)
    for q, r in zip(questions, responses):
        by_kind[q.kind].append(is_correct(r, q))
    row = {"temperature": temperature, "accuracy": sum(map(sum, by_kind.values())) / len(questions),
           "answered": sum("\\boxed{" in r for r in responses) / len(questions),
           "eval_seconds": round(time.perf_counter() - start, 1)}
    row.update({f"acc_{k}": round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())})
    return row


# ---------------------------------------------------------------------------------------------
# A feasibility probe for the RL phase: plain on-policy GRPO (one update per batch, 0/1 reward,
# group-normalized advantage, token-mean loss). Not the engine's AEPO - it only asks whether the
# warm-started policy has headroom that a few minutes of policy-gradient steps can take.


def grpo_probe(model, tokenizer, questions, tool_fn, args, seed, on_eval):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(args.rl_steps):
        pick = torch.randperm(len(questions), generator=generator)[:args.rl_prompts].tolist()
        batch = [questions[i] for i in pick for _ in range(args.rl_k)]
        model.eval()
        texts, trajectories = rollout(model, tokenizer, batch, tool_fn, args.rl_temperature,
                                      seed * 100003 + step, with_tokens=True, batch_size=len(batch))
        rewards = torch.tensor([float(is_correct(t, q)) for t, q in zip(texts, batch)]).view(-1, args.rl_k)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        model.train()
        padded = collate(trajectories, tokenizer.pad_token_id)
        logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        logprobs = torch.log_softmax(logits[:, :-1].float() / args.rl_temperature, -1)
        token_logprobs = logprobs.gather(-1, padded["input_ids"][:, 1:, None]).squeeze(-1)  # [B, T-1]
        mask = padded["loss_mask"][:, 1:]
        loss = -(advantages[:, None] * token_logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % args.rl_eval_every == 0 or step == 0:
            print(f"rl step {step + 1}: train reward {rewards.mean():.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
        if (step + 1) % args.rl_eval_every == 0:
            model.eval()
            on_eval(step + 1, time.perf_counter() - start)
    model.eval()


# ---------------------------------------------------------------------------------------------


def run(args, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    task = make_task(SyntheticTaskConfig(seed=seed, num_train=args.num_train, num_people=args.num_people))
    workdir = tempfile.mkdtemp()
    tool_fn = make_tool_fn(task, args.search, args.topk, workdir)
    demos = make_demonstrations(task.train, tool_fn)
    texts = [SYSTEM_PROMPT] + [row["contents"] for row in task.corpus] + [q.text for q in task.train] + demos
    t0 = time.perf_counter()
    path = build_tiny_qwen3(os.path.join(workdir, "model"), texts=texts, vocab_size=args.vocab,
                            hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                            num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                            intermediate_size=args.intermediate, tie_word_embeddings=args.tie, seed=seed)
    build_seconds = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    config = SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed,
                       warmup_steps=min(20, args.steps))
    examples = build_examples(tokenizer, [q.messages() for q in task.train], demos, config.max_length)
    lengths = sorted(len(e.input_ids) for e in examples)
    print(f"seed {seed}: params {n_params}, vocab {len(tokenizer)}, build {build_seconds:.1f}s, "
          f"example tokens median {lengths[len(lengths) // 2]} max {lengths[-1]}", flush=True)
    heldout = list(task.heldout)[:args.num_eval]
    rows, losses = [], []
    clock = {"train": 0.0, "last": time.perf_counter(), "cpu": 0.0, "last_cpu": time.process_time()}

    def log(entry):
        clock["train"] += time.perf_counter() - clock["last"]
        clock["cpu"] += time.process_time() - clock["last_cpu"]
        losses.append(entry["loss"])
        step = entry["step"] + 1
        if step in args.eval_at:
            model.eval()
            for temperature in args.temperatures:
                row = {"seed": seed, "step": step, "train_seconds": round(clock["train"], 1),
                       "train_cpu_seconds": round(clock["cpu"], 1),
                       "loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
                       **evaluate(model, tokenizer, heldout, tool_fn, temperature, seed)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            model.train()
        clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()

    if args.load_sft:  # reuse a saved warm start (same seed and task); skips SFT
        model = AutoModelForCausalLM.from_pretrained(args.load_sft, dtype=torch.float32).eval()
    else:
        train_sft(model, examples, config, log=log, pad_id=tokenizer.pad_token_id)
    if args.save_sft:
        model.save_pretrained(args.save_sft)
    if args.rl_steps:
        def on_eval(rl_step, seconds):
            for temperature in args.temperatures:
                row = {"seed": seed, "step": args.steps, "rl_step": rl_step, "rl_seconds": round(seconds, 1),
                       **evaluate(model, tokenizer, heldout, tool_fn, temperature, seed)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        if args.load_sft:
            on_eval(0, 0.0)  # the warm start's own accuracy, the RL baseline
        grpo_probe(model, tokenizer, list(task.train), tool_fn, args, seed, on_eval)
    if args.show:
        responses = rollout(model, tokenizer, heldout[:args.show], tool_fn, 1.0, seed)
        for q, r in zip(heldout, responses):
            print("Q:", q.text, "| gold", q.answer, "\n", r, "\n---")
    for row in rows:
        row.update(params=n_params, vocab=len(tokenizer), model_build_seconds=round(build_seconds, 1))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-at", type=int, nargs="+", default=[100, 200, 300])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-people", type=int, default=200)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    parser.add_argument("--search", choices=["exact", "bm25"], default="exact")
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=0, help="print this many sampled responses")
    parser.add_argument("--save-sft", default=None, help="save the warm-started model here")
    parser.add_argument("--load-sft", default=None, help="load a saved warm start instead of training")
    parser.add_argument("--rl-steps", type=int, default=0, help="GRPO probe steps after SFT")
    parser.add_argument("--rl-prompts", type=int, default=8)
    parser.add_argument("--rl-k", type=int, default=8)
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    parser.add_argument("--rl-temperature", type=float, default=1.0)
    parser.add_argument("--rl-eval-every", type=int, default=20)
    parser.add_argument("--out", default=None, help="append rows to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for seed in args.seeds for row in run(args, seed)]
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"command": "python bench/sft_warmstart.py " + " ".join(os.sys.argv[1:]), "commit": commit,
                "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}"}
        existing = json.load(open(args.out)) if os.path.exists(args.out) else []
        existing.append({**meta, "rows": rows})
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(existing, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
