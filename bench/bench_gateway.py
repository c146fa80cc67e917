"""The gateway's overhead per request beside a direct backend call, and concurrent sessions.

    python bench/bench_gateway.py [--sessions 256] [--turns 2] [--repeats 50] [--max-tokens 1]
        [--out bench/results/gateway.jsonl]

Overhead: the same prompt, sampled ``--repeats`` times one at a time (a new session each, so
every request renders and encodes its prompt as an agent's first request does), through the
real ``openai`` client (one connection pool, as an agent's client keeps) and the gateway, and directly with ``backend.generate`` on the same
request (the ids already encoded); the medians and their difference, with the gateway's own
count of the time it spends outside ``generate`` (parsing, rendering, encoding, recording). The
model is the tiny Qwen3 on the HF backend and ``--max-tokens 1``, so the difference is not hidden
under generation time.

Concurrency: ``--sessions`` episodes at once (asyncio, one ``AsyncOpenAI`` client each, no
retries: any error is a failed request), each ``--turns`` requests, the later ones re-sending the
conversation with a user turn added; failed requests, wall time, requests/s, the batches the
generation thread made, and peak RSS of the process (server and clients share it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, machine  # noqa: E402

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the age of Zovo?"}]


def overhead(gateway, backend, repeats: int, max_tokens: int) -> dict:
    import openai

    from aepo_engine.rollout.protocol import GenRequest

    via, direct = [], []
    pool = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=gateway.token, max_retries=0)
    for i in range(repeats + 3):  # 3 warm-up rounds
        session = gateway.open_session()
        client = pool.with_options(base_url=gateway.base_url(session))  # one connection pool, as an agent's client
        t0 = time.perf_counter()
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=max_tokens)
        t1 = time.perf_counter()
        ids = session.trajectory.prompt_ids
        gateway.close_session(session)
        request = GenRequest(tuple(ids), max_tokens, seed=i, temperature=gateway.temperature,
                             entropy_tokens=gateway.n_entropy_tokens)
        t2 = time.perf_counter()
        backend.generate([request])
        t3 = time.perf_counter()
        if i >= 3:
            via.append(t1 - t0)
            direct.append(t3 - t2)
    gateway_ms, direct_ms = statistics.median(via) * 1e3, statistics.median(direct) * 1e3
    return {"gateway_ms_median": gateway_ms, "direct_ms_median": direct_ms,
            "overhead_ms_median": gateway_ms - direct_ms,
            "overhead_ms_p90": (sorted(a - b for a, b in zip(via, direct))[int(0.9 * len(via))]) * 1e3,
            "inside_gateway_ms_mean": gateway.stats.overhead_s / max(gateway.stats.completions, 1) * 1e3,
            "batch_window_ms": gateway.batch_window_s * 1e3}


def concurrency(gateway, sessions: int, turns: int, max_tokens: int) -> dict:
    import openai

    failures: list[str] = []

    async def episode(i: int) -> int:
        session = gateway.open_session(traj_id=i)
        client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=gateway.token, max_retries=0,
                                    timeout=600)
        messages, done = list(MESSAGES), 0
        try:
            for turn in range(turns):
                try:
                    reply = await client.chat.completions.create(model="policy", messages=messages,
                                                                 max_tokens=max_tokens)
                except Exception as exc:  # noqa: BLE001 - counted
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])
                    break
                done += 1
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"And question {turn}?"}]
        finally:
            await client.close()
            gateway.close_session(session)
        return done

    async def main() -> list[int]:
        return await asyncio.gather(*(episode(i) for i in range(sessions)))

    batches = gateway.stats.batches
    t0 = time.perf_counter()
    done = asyncio.run(main())
    wall = time.perf_counter() - t0
    return {"sessions": sessions, "turns": turns, "requests_ok": sum(done), "failed_requests": len(failures),
            "first_failures": failures[:3], "wall_s": wall, "requests_per_s": sum(done) / wall,
            "generate_calls": gateway.stats.batches - batches,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[256])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS_DIR / "gateway.jsonl"))
    args = parser.parse_args()

    import torch

    from aepo_engine.gateway.server import Gateway
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.rollout.backends.hf import HFBackend

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        backend = HFBackend(build_tiny_qwen3(Path(tmp) / "model", seed=0), prefix_cache_gib=0, max_batch_size=64)
        gateway = Gateway(backend, backend.tokenizer, max_tokens=args.max_tokens, max_context_tokens=4096)
        try:
            load = {"load_avg_1m_at_start": os.getloadavg()[0]}
            rows = [{"bench": "gateway_overhead", **machine(), **load, "model": "tiny_qwen3 (HF backend, CPU, 1 thread)",
                     "max_tokens": args.max_tokens, "repeats": args.repeats,
                     **overhead(gateway, backend, args.repeats, args.max_tokens)}]
            for n in args.sessions:
                rows.append({"bench": "gateway_concurrency", **machine(), **load, "model": "tiny_qwen3 (HF backend, CPU)",
                             "max_tokens": args.max_tokens, **concurrency(gateway, n, args.turns, args.max_tokens)})
        finally:
            gateway.close()
    if args.out:
        with open(args.out, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    for row in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                          if k not in ("cpu", "torch", "date")}))


if __name__ == "__main__":
    main()
