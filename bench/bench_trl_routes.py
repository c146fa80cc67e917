"""CPU benchmark: the two routes of the TRL integration, one policy-loss training step each.

The step is what ``AEPOGRPOTrainer`` does per micro-batch: the model's forward on prompt +
completion, the AEPO loss on the completion tokens, backward (no optimizer step: it is the same
for both routes). Routes (each case in its own subprocess, see harness.py):
- ``trl_logprobs``: TRL 1.16's fused LM head (``trl.trainer.utils.add_fused_lm_head``, the one
  ``GRPOTrainer`` installs) returns per-token log-probs and entropies without ``[N, V]`` logits,
  then ``aepo_kernels.policy_loss_from_logprobs``. TRL's chunked head recomputes the logits
  blocks in backward: 4 matmuls of 2 N D V flops.
- ``fused_linear``: the backbone's hidden states into ``aepo_kernels.fused_linear_aepo_policy_loss``
  (one pass, the gradient computed in the forward loop: 3 matmuls of 2 N D V flops).
Both get the same global entropy statistics and token count (the trainer supplies them), so
neither pays for a statistics pass. The first repeat of every case checks that the two routes'
losses agree with the materialised-logits reference (``aepo_policy_loss(backend="reference")``).

Models: a Qwen3 with the tiny model's shapes (``aepo_engine.models.tiny_qwen3`` defaults: hidden
128, 2 layers) and a given vocab, random init; nothing downloaded.

    python bench/bench_trl_routes.py                              # vocab 1024 and 151936
    python bench/bench_trl_routes.py --vocab 32768 --batch 8 --prompt 32 --completion 256
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import measure, print_table, run_case_subprocess, write_rows  # noqa: E402

ROUTES = ["trl_logprobs", "fused_linear"]


def build_model(vocab: int, hidden: int, layers: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=3 * hidden, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).float()


def make_batch(vocab: int, batch: int, prompt: int, completion: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + completion), generator=g)      # [B, P + C]
    lengths = torch.randint(completion // 2, completion + 1, (batch,), generator=g)
    mask = (torch.arange(completion)[None] < lengths[:, None]).float()           # [B, C]
    attention = torch.cat([torch.ones(batch, prompt), mask], 1).long()
    return {"input_ids": ids, "attention_mask": attention, "completion_ids": ids[:, prompt:], "mask": mask,
            "old_logprobs": -torch.rand(batch, completion, generator=g) * 5,
            "advantages": torch.randn(batch, generator=g)}


def step_fn(route: str, model, config, temperature: float):
    """``step(batch, entropy_mean, entropy_std, count) -> loss`` (forward + loss; caller does backward)."""
    from aepo_kernels import fused_linear_aepo_policy_loss, policy_loss_from_logprobs

    if route == "trl_logprobs":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))

        def step(b, mean, std, count):
            completion = b["completion_ids"].shape[1]
            labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
            labels[:, :-completion] = -100
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels, fused_lm_head=True)
            logps, entropy = out.log_probs[:, -completion:], out.entropy[:, -completion:]
            return policy_loss_from_logprobs(logps, entropy, b["old_logprobs"], b["advantages"], b["mask"], config=config,
                                             entropy_mean=mean, entropy_std=std, global_token_count=count)[0]
        return step

    def step(b, mean, std, count):
        completion = b["completion_ids"].shape[1]
        hidden = model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
        hidden = hidden[:, -completion - 1:-1]                                   # [B, C, D] predicts completion
        return fused_linear_aepo_policy_loss(hidden, model.lm_head.weight, b["completion_ids"], b["old_logprobs"],
                                             b["advantages"], b["mask"], config=config, temperature=temperature,
                                             backend="torch", entropy_mean=mean, entropy_std=std,
                                             global_token_count=count, shift_labels=False)[0]
    return step


def reference_loss(model, b, config, temperature, mean, std, count) -> torch.Tensor:
    from aepo_kernels import aepo_policy_loss

    completion = b["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, -completion - 1:-1]
        return aepo_policy_loss(logits.float(), b["completion_ids"], b["old_logprobs"], b["advantages"], b["mask"],
                                config=config, temperature=temperature, backend="reference", entropy_mean=mean,
                                entropy_std=std, global_token_count=count, shift_labels=False)[0]


def run_case(route: str, vocab: int, hidden: int, layers: int, batch: int, prompt: int, completion: int,
             warmup: int, repeats: int) -> dict:
    from aepo_kernels import LossConfig

    torch.set_num_threads(max(1, torch.get_num_threads()))
    config, temperature = LossConfig(), 0.9
    model = build_model(vocab, hidden, layers)
    b = make_batch(vocab, batch, prompt, completion)
    mean, std, count = torch.tensor(2.0), torch.tensor(0.5), b["mask"].sum()
    expected = reference_loss(model, b, config, temperature, mean, std, count)
    step = step_fn(route, model, config, temperature)
    got = step(b, mean, std, count)
    if not torch.allclose(got.detach(), expected, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{route}: loss {got.item()} != reference {expected.item()}")

    def setup():
        model.zero_grad(set_to_none=True)

    def body(_):
        t0 = time.perf_counter()
        loss = step(b, mean, std, count)
        t1 = time.perf_counter()
        loss.backward()
        return {"fwd_s": t1 - t0, "bwd_s": time.perf_counter() - t1}

    row = measure(setup, body, warmup=warmup, repeats=repeats)
    n = batch * (prompt + completion)
    row.update(route=route, vocab=vocab, hidden=hidden, layers=layers, batch=batch, prompt=prompt,
               completion=completion, tokens=n, loss_matches_reference=True,
               head_matmul_flops=(4 if route == "trl_logprobs" else 3) * 2 * batch * completion * hidden * vocab)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    parser.add_argument("--route", nargs="+", default=ROUTES, choices=ROUTES)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="do not append rows to bench/results")
    args = parser.parse_args()
    if args.case_json:
        print(json.dumps(run_case(**json.loads(args.case_json))))
        return
    rows = []
    for vocab in args.vocab:
        for route in args.route:
            case = dict(route=route, vocab=vocab, hidden=args.hidden, layers=args.layers, batch=args.batch,
                        prompt=args.prompt, completion=args.completion, warmup=args.warmup, repeats=args.repeats)
            row = run_case_subprocess(Path(__file__), ["--case-json", json.dumps(case)])
            rows.append({**case, **row})
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    for row in rows:
        row["loadavg"] = load
    if not args.no_write:
        write_rows("trl_routes_cpu", rows)
    print(f"load average at the end: {load}")
    print_table(rows, ["route", "vocab", "tokens", "total_s", "total_spread_s", "fwd_s", "bwd_s", "peak_bytes", "error"])


if __name__ == "__main__":
    main()
