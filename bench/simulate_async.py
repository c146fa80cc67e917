"""A prediction, not a measurement: synchronous vs asynchronous step time for the paper's node
(8 x H200, Qwen3-14B, 64 prompts x 12 trajectories), from the trajectories measured on the CPU job.

    python bench/simulate_async.py --runs runs/bench-async [--mean-model-tokens 1500] [--out bench/results/async_simulation.jsonl]

What it takes from the measured runs (``--runs``: run folders of ``bench/bench_async.py``, their
sample dumps ``logs/samples/step_*.jsonl``): the shape of every dumped trajectory -- how many tool
calls, and how its model tokens and tool-result tokens split over its segments -- as an empirical
distribution, drawn with replacement. Lengths are scaled to the paper's: model tokens by
``--mean-model-tokens / measured mean`` (capped at ``rollout.max_response_tokens``), tool results by
``--tool-result-tokens / measured mean``. Tool latencies: search from the retrieval server's
latency (``LatencyConfig``: log-normal, median 1 s, sigma 0.65, cap 8 s: the ``web_search``
preset, which the measured runs used), python calls a fixed 0.3 s.

Assumptions (every one a flag): H200 HBM 4.8 TB/s at 70% achieved, bf16 989 TFLOP/s dense at 45%
for the engines and 35% for training (FSDP2, activation checkpointing: 8 P T FLOPs for forward,
backward and recompute, plus 2 P T for the proximal log-prob pass); an engine decode step reads
the weights and every active sequence's KV once, ``t = (2P/tp + KV) / BW + 2 P N / (tp F)``;
prefill of a tool result ``2 P n / (tp F)``; active sequences capped by the engine's KV cache and
``max_num_seqs`` (the memory plan's vLLM arithmetic, ``memory_plan.engine_kv_cache``, for the
paper's preset: ``gpu_memory_utilization`` 0.6 colocated, 0.9 for an engine on GPUs of its own); a weight update re-prefills the contexts in flight (their
cached keys and values came from the old weights); weight sync 2 s colocated (in-process, by
reference) and a 29.5 GB bf16 push at 50 GB/s (a broadcast over NVLink; the byte path through host
memory that runs today would be far slower) for split placements; 64 prompt tokens of system prompt
plus 1,000 of question per prompt. Not modelled: branching (every trajectory is an independent
sample), stragglers' preemption by vLLM, the trainer's scoring and host work, and network time.
Placements: colocated sync (the engines in the 8 training ranks, sleeping during the update; 4
engines of 2 GPUs, the preset's, and 8 of 1) and split ``E`` engine GPUs + ``8 - E`` trainer GPUs
where the memory plan fits both roles.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, write_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    bandwidth: float = 4.8e12 * 0.70      # bytes/s achieved HBM bandwidth per GPU
    engine_flops: float = 989e12 * 0.45    # bf16 FLOP/s an engine reaches
    train_flops: float = 989e12 * 0.35     # bf16 FLOP/s training reaches (MFU)
    colocated_sync_s: float = 2.0          # weight sync into in-process engines, by reference
    push_bytes_per_s: float = 50e9         # split: the weights broadcast to the engines


@dataclass(frozen=True)
class Job:
    params: float = 14.77e9
    kv_bytes_per_token: float = 163840.0  # Qwen3-14B, bf16 (aepo_engine.memory_plan.engine_kv_cache)
    prompts: int = 64
    k: int = 12
    prompt_tokens: int = 1064
    max_response: int = 6192


@dataclass
class Shape:
    """A trajectory: model-token counts of its segments and, between them, tool calls (kind, result tokens)."""

    segments: list[int]
    tools: list[tuple[str, int]]


# ---------------------------------------------------------------------------------------------
# Measured shapes


def load_shapes(runs: list[Path]) -> list[Shape]:
    """Every dumped trajectory of the runs' sample dumps (branches included, as whole trajectories)."""
    shapes = []
    for path in sorted(p for run in runs for p in run.glob("**/logs/samples/step_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            segments = [end - start for kind, start, end in row["segments"] if kind == "model"]
            results = [end - start for kind, start, end in row["segments"] if kind == "tool"]
            kinds = [call["tool"] for call in row.get("tool_log", [])]
            if segments:
                shapes.append(Shape(segments, list(zip(kinds + ["search"] * len(results), results))[:len(results)]))
    return shapes


def scale_shapes(shapes: list[Shape], mean_model_tokens: float, tool_result_tokens: float, job: Job) -> list[Shape]:
    """Lengths scaled to the paper's (module docstring), model tokens capped at the response budget."""
    model_mean = sum(sum(s.segments) for s in shapes) / len(shapes)
    results = [n for s in shapes for _, n in s.tools]
    result_mean = sum(results) / max(len(results), 1)
    a, b = mean_model_tokens / model_mean, tool_result_tokens / max(result_mean, 1e-9)
    out = []
    for s in shapes:
        segments = [max(1, round(n * a)) for n in s.segments]
        over = sum(segments) - job.max_response
        if over > 0:
            segments[-1] = max(1, segments[-1] - over)
        out.append(Shape(segments, [(kind, max(1, round(n * b))) for kind, n in s.tools]))
    return out


# ---------------------------------------------------------------------------------------------
# The engine model


class Engine:
    """One vLLM engine over ``tp`` GPUs, advanced in chunks of decode steps (module docstring)."""

    def __init__(self, hw: Hardware, job: Job, tp: int, kv_tokens: int, max_seqs: int | None = None):
        self.hw, self.job, self.tp, self.kv_tokens = hw, job, tp, kv_tokens
        self.max_seqs = max_seqs or 10**9  # vLLM's max_num_seqs: sequences decoded at once
        self.busy_s = 0.0

    def decode_step_s(self, contexts: list[int]) -> float:
        weights = 2 * self.job.params / self.tp
        kv = sum(contexts) * self.job.kv_bytes_per_token / self.tp
        return (weights + kv) / self.hw.bandwidth + 2 * self.job.params * len(contexts) / (self.tp * self.hw.engine_flops)

    def prefill_s(self, tokens: int) -> float:
        return 2 * self.job.params * tokens / (self.tp * self.hw.engine_flops)


@dataclass
class Traj:
    step: int
    shape: Shape
    context: int
    segment: int = 0          # index of the model segment being decoded
    left: int = 0             # tokens left in it
    ready_at: float = 0.0     # when its tool result is back (prefill pending)
    prefill: int = 0          # tokens to prefill before decoding again
    done_at: float | None = None


def _latency(rng: random.Random, kind: str) -> float:
    if kind == "python":
        return 0.3
    return min(1.0 * math.exp(0.65 * rng.gauss(0.0, 1.0)), 8.0)


def run_engine(engine: Engine, trajs: list[Traj], until: float, now: float, rng: random.Random,
               chunk: int = 8) -> float:
    """Advance ``engine`` over its trajectories from ``now`` to ``until`` (or until none is left);
    returns the time reached."""
    while now < until:
        live = [t for t in trajs if t.done_at is None]
        if not live:
            return now
        ready = [t for t in live if t.ready_at <= now]
        if not ready:
            now = min(min(t.ready_at for t in live), until)
            continue
        ready.sort(key=lambda t: (t.step, t.context))  # oldest step first
        active, kv = [], 0
        for t in ready:
            if (kv + t.context + t.left > engine.kv_tokens or len(active) >= engine.max_seqs) and active:
                break
            active.append(t)
            kv += t.context + t.left
        prefill = sum(t.prefill for t in active)
        steps = min(chunk, min(t.left for t in active))
        dt = engine.prefill_s(prefill) + steps * engine.decode_step_s([t.context for t in active])
        for t in active:
            t.prefill = 0
            t.left -= steps
            t.context += steps
            if t.left == 0:
                _end_segment(t, now + dt, rng)
        engine.busy_s += dt
        now += dt
    return now


def _end_segment(t: Traj, now: float, rng: random.Random) -> None:
    if t.segment >= len(t.shape.tools):
        t.done_at = now
        return
    kind, result = t.shape.tools[t.segment]
    t.ready_at = now + _latency(rng, kind)
    t.prefill = result
    t.context += result
    t.segment += 1
    t.left = t.shape.segments[t.segment] if t.segment < len(t.shape.segments) else 0
    if t.left == 0:
        t.done_at = t.ready_at


def new_trajs(step: int, shapes: list[Shape], job: Job, rng: random.Random) -> list[Traj]:
    picked = [rng.choice(shapes) for _ in range(job.prompts * job.k)]
    return [Traj(step, s, job.prompt_tokens, left=s.segments[0], prefill=job.prompt_tokens) for s in picked]


def update_s(hw: Hardware, job: Job, trajs: list[Traj], gpus: int) -> float:
    tokens = sum(t.context for t in trajs)
    return 10 * job.params * tokens / (gpus * hw.train_flops)


# ---------------------------------------------------------------------------------------------
# The two schedules


def simulate_sync(hw: Hardware, job: Job, shapes: list[Shape], steps: int, kv_tokens: int, seed: int, tp: int = 1,
                  max_seqs: int | None = None) -> dict:
    """Colocated: ``8 / tp`` engines (in the training ranks) sample a step, then 8 GPUs update, then
    the weights sync."""
    rng = random.Random(seed)
    n = 8 // tp
    engines = [Engine(hw, job, tp, kv_tokens, max_seqs) for _ in range(n)]
    now, parts = 0.0, {"rollout_s": 0.0, "update_s": 0.0, "sync_s": 0.0}
    for step in range(steps):
        trajs = new_trajs(step, shapes, job, rng)
        ends = [run_engine(e, trajs[i::n], math.inf, now, rng) for i, e in enumerate(engines)]
        rollout = max(ends) - now
        update = update_s(hw, job, trajs, 8)
        parts["rollout_s"] += rollout
        parts["update_s"] += update
        parts["sync_s"] += hw.colocated_sync_s
        now += rollout + update + hw.colocated_sync_s
    return {"schedule": f"sync, colocated: {n} engines of {tp} GPU(s) in the 8 training ranks", "step_s": now / steps,
            **{k: v / steps for k, v in parts.items()}, "engine_busy": sum(e.busy_s for e in engines) / (n * now)}


def simulate_async(hw: Hardware, job: Job, shapes: list[Shape], steps: int, engine_gpus: int, tp: int,
                   kv_tokens: int, eta: int, seed: int, max_seqs: int | None = None) -> dict:
    """Split: ``engine_gpus / tp`` engines sample continuously; ``8 - engine_gpus`` GPUs update; step
    ``s`` starts once version ``s - eta`` is loaded; an update re-prefills the contexts in flight."""
    rng = random.Random(seed)
    n = engine_gpus // tp
    engines = [Engine(hw, job, tp, kv_tokens, max_seqs) for _ in range(n)]
    per_engine: list[list[Traj]] = [[] for _ in range(n)]
    by_step: dict[int, list[Traj]] = {}
    push = 2 * job.params / hw.push_bytes_per_s
    now, version, trainer_free, admitted = 0.0, 0, 0.0, 0
    waits = 0.0
    finished_at = []
    while len(finished_at) < steps:
        while admitted < steps and admitted - eta <= version:
            by_step[admitted] = new_trajs(admitted, shapes, job, rng)
            for i, t in enumerate(by_step[admitted]):
                per_engine[i % n].append(t)
            admitted += 1
        step = len(finished_at)
        # run the engines until this step's trajectories are all done
        horizon = now
        while any(t.done_at is None for t in by_step[step]):
            horizon += 5.0
            for e, trajs in zip(engines, per_engine):
                run_engine(e, trajs, horizon, now, rng)
            now = horizon
        data_at = max(t.done_at for t in by_step[step])
        start = max(data_at, trainer_free)
        waits += max(0.0, data_at - trainer_free)
        end = start + update_s(hw, job, by_step[step], 8 - engine_gpus) + push
        # the engines run on until the new weights land, then re-prefill what is in flight
        for e, trajs in zip(engines, per_engine):
            run_engine(e, trajs, end, now, rng)
            live = [t for t in trajs if t.done_at is None]
            refill = e.prefill_s(sum(t.context for t in live))  # one batch, before anything decodes again
            e.busy_s += refill
            for t in live:
                t.ready_at = max(t.ready_at, end + refill)
        now = max(now, end)
        trainer_free = end
        version += 1
        finished_at.append(end)
        for trajs in per_engine:
            trajs[:] = [t for t in trajs if t.done_at is None]
    total, warm = finished_at[-1], min(2, steps - 1)  # steady state: the first steps fill the pipeline
    steady = (total - finished_at[warm - 1]) / (steps - warm) if warm else total / steps
    return {"schedule": _label(engine_gpus, tp, eta), "step_s": steady, "first_steps_s": finished_at[warm - 1] / warm
            if warm else None, "trainer_wait_s": waits / steps, "update_s": update_s(hw, job, by_step[0], 8 - engine_gpus),
            "push_s": push, "engine_busy": sum(e.busy_s for e in engines) / (n * total)}


def _label(engine_gpus: int, tp: int, eta: int) -> str:
    return f"async eta {eta}, split: {8 - engine_gpus} trainer GPUs + {engine_gpus // tp} engines of {tp} GPU(s)"


def kv_capacity(engine_gpus: int, tp: int, trainer_gpus: int, eta: int) -> tuple[int, bool, int]:
    """An engine's KV tokens, whether the memory plan fits (both roles, one H200 each, when split) and
    the sequences it decodes at once (``max_num_seqs``): the memory plan's vLLM arithmetic
    (``memory_plan.engine_kv_cache``) for the paper's preset with ``tp`` GPUs per engine."""
    from aepo_engine.config import load_train_config
    from aepo_engine.memory_plan import ModelShape, gpu_bytes, plan_memory
    from aepo_engine.placement import plan_placement

    sys.path.insert(0, str(REPO / "tests"))
    from test_memory_plan import QWEN3_14B

    shape, h200 = ModelShape.from_config(QWEN3_14B), gpu_bytes("h200")
    base = ["--preset", "qwen3_14b_deep_research", "--model.path=/m", f"--backend.tensor_parallel_size={tp}"]
    if engine_gpus == 0:  # colocated: the engines in the 8 training ranks, the preset's gpu_memory_utilization
        plan = plan_memory(load_train_config(base), shape, 8, h200, gpu_name="h200")
        return plan.kv.tokens, plan.fits, plan.kv.max_num_seqs
    cfg = load_train_config([*base, "--backend.placement=split", f"--backend.rollout_gpus={engine_gpus}",
                             "--train.mode=async", f"--train.max_staleness={eta}", "--backend.gpu_memory_utilization=0.9"]
                            + (["--backend.in_process=false"] if tp > 1 else []))
    split = plan_placement(cfg, shape, trainer_gpus, h200, gpu_name="h200")
    return split.kv_tokens, split.fits, split.engine.kv.max_num_seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, nargs="+", default=[REPO / "runs" / "bench-async"])
    parser.add_argument("--mean-model-tokens", type=float, nargs="+", default=[1500.0, 3000.0])
    parser.add_argument("--tool-result-tokens", type=float, default=700.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="async_simulation", help="bench/results/<name>.jsonl ('' = do not write)")
    args = parser.parse_args()
    job, hw = Job(), Hardware()
    measured = load_shapes(args.runs)
    if not measured:
        raise SystemExit(f"no sample dumps under {args.runs}")
    rows = []
    for mean_tokens in args.mean_model_tokens:
        rows += simulate_all(hw, job, scale_shapes(measured, mean_tokens, args.tool_result_tokens, job), args.steps,
                             args.seed, {"measured_trajectories": len(measured), "mean_model_tokens": mean_tokens,
                                         "tool_result_tokens": args.tool_result_tokens, "steps": args.steps,
                                         "prediction": True, "hardware": hw.__dict__})
    for row in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "hardware"}),
              flush=True)
    if args.results:
        write_rows(args.results, rows, machine())


def simulate_all(hw: Hardware, job: Job, shapes: list[Shape], steps: int, seed: int, common: dict) -> list[dict]:
    """Sync colocated (engines of 2 GPUs, the preset's, and of 1), then every split placement (and
    eta 1, 2) the memory plan fits; speed-ups against the faster synchronous schedule that fits."""
    rows = []
    for tp in (2, 1):
        kv, fits, seqs = kv_capacity(0, tp, 8, 0)
        row = {**common, "fits": fits, "kv_tokens": kv, "max_num_seqs": seqs}
        if fits:
            row.update(simulate_sync(hw, job, shapes, steps, kv, seed, tp, seqs))
        else:
            row["schedule"] = f"sync, colocated: {8 // tp} engines of {tp} GPU(s): does not fit (memory plan)"
        rows.append(row)
    baseline = min(row["step_s"] for row in rows if "step_s" in row)
    for engine_gpus, tp in ((2, 1), (4, 1), (4, 2), (6, 1), (6, 2)):
        for eta in (1, 2):
            kv, fits, seqs = kv_capacity(engine_gpus, tp, 8 - engine_gpus, eta)
            row = {**common, "fits": fits, "kv_tokens": kv, "max_num_seqs": seqs}
            if fits:
                row.update(simulate_async(hw, job, shapes, steps, engine_gpus, tp, kv, eta, seed, seqs))
            else:
                row["schedule"] = _label(engine_gpus, tp, eta) + ": does not fit (memory plan)"
            rows.append(row)
    for row in rows:
        if "step_s" in row:
            row["speedup_vs_sync"] = round(baseline / row["step_s"], 2)
    return rows


if __name__ == "__main__":
    main()
