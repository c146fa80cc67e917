"""Cost of the counterfactual statistics (``policy.counterfactual_stats``) in ``PolicyWorker.update``.

The measurement reuses what the loss computed (per-token log-probs and entropies, returned as rows)
and evaluates the kernels' per-token head four more times per micro-batch, elementwise on
``[b, l]`` (``training.counterfactual``): O(tokens) work next to the O(tokens x (params + V)) of the
forward/backward. This benchmark times whole ``update()`` calls with the statistics on and off, in
alternation (on, off, on, off, ...) so that a change in machine load hits both alike, on a batch
shaped like one step of the embedded run: 16 prompts x k=8 trajectories, a 40-token prompt, responses
of 20-160 tokens with a tool result in half of them and a branch (a fork after the tool result) in
every fourth group slot, the embedded model's shape (tiny Qwen3: 4 layers, width 128, V=1024;
``initializer_range`` 0.3 so that entropies spread as after a warm start), old log-probs moved by
noise so that the clip acts. Besides the two medians (whose difference is within the noise of a
loaded machine) it reports ``cf_s``, the seconds spent inside the statistics' own code per update
(``PolicyWorker._counterfactual_sums``, timed around each call), and its share of the update.
Rows go to ``bench/results/counterfactual_overhead.jsonl``.

    python bench/bench_counterfactual.py                          # off-policy preset's mini-batches (2 prompts)
    python bench/bench_counterfactual.py --mini-batch 8 --repeats 9
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, write_rows  # noqa: E402

RESULTS_NAME = "counterfactual_overhead"


def make_batch(vocab: int, prompts: int, k: int, seed: int):
    """The trajectories of one embedded-like step as a TokenBatch (module docstring)."""
    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(10, vocab, (n,), generator=gen).tolist()  # noqa: E731
    length = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    trajs = []
    for p in range(prompts):
        prompt = ids(40)
        for j in range(k):
            if j % 4 == 3 and trajs[-1].segments[-1].kind == "tool":  # a branch of the previous trajectory
                child = trajs[-1].fork(len(trajs[-1].segments), j)
                n = length(10, 60)
                child.append_model_segment(ids(n), [-1.0] * n, [0.0] * n, 2)
                trajs.append(child)
                continue
            traj = Trajectory(prompt_ids=prompt, prompt_index=p, traj_id=j, step=0, kind="global")
            n = length(20, 100)
            traj.append_model_segment(ids(n), [-1.0] * n, [0.0] * n, 2)
            if j % 2 == 0:
                traj.append_tool_result(ids(12))
                if j % 4 != 2:  # slots 0 and 1 (mod 4) answer; slot 2 is left for the branch in slot 3
                    n = length(10, 48)
                    traj.append_model_segment(ids(n), [-1.0] * n, [0.0] * n, 2)
            trajs.append(traj)
    return TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=gen))


def _time_calls(obj, name: str) -> list[float]:
    """Wrap ``obj.<name>`` (on the instance) so that each call's seconds are appended to the returned list."""
    seconds: list[float] = []
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        result = method(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return result

    setattr(obj, name, timed)
    return seconds


def run(mini_batch: int, repeats: int, warmup: int, seed: int) -> list[dict]:
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.training import PolicyConfig, PolicyWorker
    from aepo_engine.training.optim import OptimConfig

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3(Path(tmp) / "m", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4,
                                 num_kv_heads=2, head_dim=32, intermediate_size=384, tie_word_embeddings=True,
                                 initializer_range=0.3)
        base = PolicyConfig(param_dtype="float32", micro_batch_size=32, ppo_mini_batch_size=mini_batch)
        workers = {mode: PolicyWorker(str(model), msgspec.structs.replace(base, counterfactual_stats=mode == "on"),
                                      OptimConfig(lr=3e-4, weight_decay=0.0), total_steps=1000)
                   for mode in ("on", "off")}
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size  # the BPE may learn fewer than 1024 tokens
        batch = make_batch(vocab, 16, 8, seed)
        logp, entropy = workers["on"].compute_logprobs(batch)
        gen = torch.Generator().manual_seed(seed + 1)
        batch = dataclasses.replace(batch, old_logprobs=logp + 0.3 * torch.randn(logp.shape, generator=gen),
                                    entropy=entropy)
        times: dict[str, list[float]] = {"on": [], "off": [], "cf": []}
        inside = _time_calls(workers["on"], "_counterfactual_sums")
        report = {}
        for i in range(warmup + repeats):
            for mode in ("on", "off"):
                inside.clear()
                t0 = time.perf_counter()
                out = workers[mode].update(batch)
                if i >= warmup:
                    times[mode].append(time.perf_counter() - t0)
                    if mode == "on":
                        times["cf"].append(sum(inside))
                report[mode] = out
        tokens = int(batch.loss_mask.sum())
    on, off, cf = (statistics.median(times[m]) for m in ("on", "off", "cf"))
    return [{"case": "update", "rows": batch.num_rows, "tokens": tokens, "width": batch.input_ids.shape[1],
             "mini_batch_prompts": mini_batch, "optimizer_steps": report["on"]["optimizer_steps"],
             "on_s": on, "off_s": off, "overhead": on / off - 1.0, "cf_s": cf, "cf_share": cf / on,
             "on_samples": times["on"], "off_samples": times["off"], "cf_samples": times["cf"],
             "cf_high_kept_frac": report["on"].get("cf/high_kept_frac"),
             "clipfrac_high": report["on"]["clipfrac_high"]}]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mini-batch", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only, write no rows")
    args = parser.parse_args(argv)
    rows = run(args.mini_batch, args.repeats, args.warmup, args.seed)
    if not args.no_write:
        write_rows(RESULTS_NAME, rows)
    print_table(rows, ["rows", "tokens", "mini_batch_prompts", "optimizer_steps", "on_s", "off_s", "overhead", "cf_s",
                       "cf_share", "cf_high_kept_frac", "clipfrac_high"])


if __name__ == "__main__":
    main()
