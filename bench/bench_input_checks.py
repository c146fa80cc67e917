"""CPU benchmark: what the input contract (kernels/contract.py) costs a loss call.

Cases (each in its own subprocess, see harness.py):
- ``checks``: exactly the checks ``aepo_policy_loss`` runs before its pass -- the logits/labels
  metadata, every per-token argument's metadata, and the value rules (labels in ``[0, V)`` or
  ``ignore_index``, ``loss_mask`` and ``token_weights`` finite and >= 0), each read on the host
  as the CPU path does. Bytes: the value rules read the ``[N]`` labels (8 B), mask (4 B) and
  weights (4 B) a few times; nothing ``[N, V]``.
- ``loss``: the whole one-pass loss the checks precede (forward + backward, in place, entropy
  statistics and token count supplied: the trainer's fast path; ``backend="auto"``), for scale.
On ``--device cuda`` the value rules are not read on the host but queued as device asserts
(kernels/contract.py); each timed repeat ends with a synchronisation.

    python bench/bench_input_checks.py                      # N in {1024, 4096, 16384}, V = 32,000
    python bench/bench_input_checks.py --n 4096 --vocab 151936 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, measure, print_table, run_case_subprocess, write_rows  # noqa: E402

IMPLS = ["checks", "loss"]


def _inputs(n: int, vocab: int, with_logits: bool, device: str):
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::7] = -100
    per_token = dict(old_logprobs=-torch.rand(n, generator=gen), advantages=torch.randn(n, generator=gen),
                     loss_mask=(torch.rand(n, generator=gen) > 0.1).float(), ref_logprobs=None,
                     token_weights=torch.rand(n, generator=gen) + 0.5)
    # The checks read the logits' metadata only: a stride-0 view stands in for [N, V] memory.
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    logits = move(torch.randn(n, vocab, generator=gen)) if with_logits else torch.zeros(1, device=device).expand(n, vocab)
    return logits, move(labels), {name: move(t) for name, t in per_token.items()}


def run_case(impl: str, n: int, vocab: int, warmup: int, repeats: int, device: str = "cpu") -> dict:
    from aepo_kernels import LossConfig, aepo_policy_loss, contract

    logits, labels, tokens = _inputs(n, vocab, with_logits=impl == "loss", device=device)

    if impl == "checks":
        def body(_):
            for _ in range(100):  # one call is ~microseconds: time 100, report per call below
                contract.check_logits("f", logits, labels)
                contract.check_loss_tokens("f", labels, "labels", tokens, None)
                contract.enforce("f", [contract.label_rule(labels, vocab, -100)])
        setup = lambda: None  # noqa: E731
    else:
        stats = {k: torch.tensor(v, device=device) for k, v in
                 dict(entropy_mean=2.0, entropy_std=1.0, global_token_count=float(n)).items()}

        def setup():
            leaf = logits.clone().requires_grad_()
            return leaf, leaf.view_as(leaf)

        def body(state):
            _, z = state
            loss, _ = aepo_policy_loss(z, labels, tokens["old_logprobs"], tokens["advantages"], tokens["loss_mask"],
                                       shift_labels=False, config=LossConfig(), inplace_backward=True,
                                       token_weights=tokens["token_weights"], **stats)
            loss.backward()

    cpu0 = time.process_time()
    row = measure(setup, body, warmup=warmup, repeats=repeats, device=device)  # CUDA: synchronised at the end
    row["cpu_s"] = time.process_time() - cpu0
    if impl == "checks":
        row["per_call_s"] = row["total_s"] / 100
    row.update(impl=impl, n=n, vocab=vocab, device=device, threads=torch.get_num_threads(),
               load_1min=os.getloadavg()[0])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", nargs="+", default=IMPLS, choices=IMPLS)
    parser.add_argument("--n", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the checks then queue device asserts")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_json:
        case = json.loads(args.case_json)
        print(json.dumps(run_case(**case)))
        return
    info = machine()
    rows = []
    for n in args.n:
        for impl in args.impl:
            case = dict(impl=impl, n=n, vocab=args.vocab, warmup=args.warmup, repeats=args.repeats, device=args.device)
            row = run_case_subprocess(Path(__file__), ["--case-json", json.dumps(case)])
            rows.append({**case, **row})
    write_rows("input_checks_cpu", rows, info)
    print_table(rows, ["impl", "n", "vocab", "per_call_s", "total_s", "total_spread_s", "peak_bytes", "load_1min"])


if __name__ == "__main__":
    main()
