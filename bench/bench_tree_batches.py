"""Training on the rollout tree (``policy.tree_batches``) against one row per trajectory, side by side.

Three commands:

    python bench/bench_tree_batches.py dump RUN_DIR OUT.pt [--steps N] [trainer args ...]
        Runs N steps of the default job (embedded preset, its set-up reused from RUN_DIR/setup)
        and saves every step's batch as the update receives it, with the trajectories' lineage.
    python bench/bench_tree_batches.py compare BATCHES.pt [--repeats R] [--config-args ...]
        One process, two PolicyWorkers on the job's warm-started model (rows / tree), the same
        weights before every measurement; per batch the update (log-prob pass + PPO update) of
        each layout, alternating which goes first; median wall and CPU time, positions computed
        / row positions, the peak resident set above the one before each update (median), and the
        equality of log-probs, entropies and every parameter's gradient.
    python bench/bench_tree_batches.py paper BATCHES.pt [--prompts 64 --k 12 ...]
        Paper-shaped batches from a synthetic generator that follows the branch positions measured
        in BATCHES.pt (module :func:`paper_batch`): positions and the FLOP count of a Qwen3-14B
        update on rows and on trees (what a GPU would see), no model run.

Rows go to ``bench/results/tree_batches.jsonl`` with machine, commit, load and CPU time. Run
``compare`` on a quiet machine when you can: the figure is a ratio of two runs interleaved in one
process, so a steady load moves both, but a burst moves one.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import PeakMemory, machine, print_table, write_rows  # noqa: E402

from aepo_engine.training.batch import TokenBatch  # noqa: E402
from aepo_engine.training.tree import (TreeMicroBatch, build_forest, group_slices, logprob_keys,  # noqa: E402
                                      position_ratio)


# --- dump ----------------------------------------------------------------------------------------

def lineage(traj) -> dict:
    """What the paper-shaped generator reads from a trajectory."""
    tool_starts = [s.start for s in traj.segments if s.kind == "tool"] if hasattr(traj, "segments") else []
    return {"group": traj.prompt_index, "kind": traj.kind, "parent": traj.parent_id, "prompt": len(traj.prompt_ids),
            "response": len(traj.response_ids), "branch_position": traj.branch_position, "tool_starts": tool_starts}


def dump(run_dir: str, out: str, steps: int, extra: list[str]) -> None:
    from aepo_engine.config import load_train_config
    from aepo_engine.train import Trainer

    cfg = load_train_config([f"--run_dir={run_dir}", f"--train.steps={steps}", "--eval.num_questions=1",
                             "--checkpoint.every_n_steps=0", *extra])
    trainer = Trainer(cfg)
    saved, update = [], trainer.policy.update
    captured = {}

    def capture(batch):
        captured["batch"] = batch
        return update(batch)

    trainer.policy.update = capture
    run_step = trainer.rollout.run_step

    def keep_trajectories(prompts, step):
        result = run_step(prompts, step)
        captured["trajectories"] = [lineage(t) for t in result.trajectories]
        return result

    trainer.rollout.run_step = keep_trajectories
    trainer.source = trainer.make_step_source()
    trainer.source.start(0)
    for step in range(steps):
        metrics = trainer.step(step)
        batch = captured["batch"]
        saved.append({"batch": {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)},
                      "trajectories": captured["trajectories"], "step": step,
                      "reward": metrics["reward/mean"], "branches": metrics["rollout/branches"]})
        print(f"step {step}: {batch.num_rows} rows, reward {metrics['reward/mean']:.3f}, "
              f"branches {metrics['rollout/branches']:.0f}", flush=True)
    torch.save({"model_dir": str(trainer.model_dir), "policy": msgspec_dict(cfg.policy),
                "optim": msgspec_dict(cfg.optim),
                "temperature": cfg.rollout.temperature, "steps": saved}, out)
    print(f"saved {len(saved)} batches to {out}")


def msgspec_dict(struct) -> dict:
    import msgspec

    return msgspec.to_builtins(struct)


def load_batches(path: str) -> tuple[dict, list[TokenBatch]]:
    data = torch.load(path, weights_only=False)
    return data, [TokenBatch(**step["batch"]) for step in data["steps"]]


# --- compare -------------------------------------------------------------------------------------

def make_worker(data: dict, trees: bool, overrides: dict):
    import msgspec

    from aepo_engine.training import OptimConfig, PolicyConfig, PolicyWorker

    policy = msgspec.convert({**data["policy"], **overrides, "tree_batches": "on" if trees else "off"}, PolicyConfig)
    optim = msgspec.convert(data["optim"], OptimConfig)
    return PolicyWorker(data["model_dir"], policy, optim, total_steps=1000, temperature=data["temperature"])


def _malloc_trim() -> None:
    """Hand glibc's freed heap back to the OS, so the next update's resident-set growth is its own
    (without it an update reuses pages the previous one left resident and its peak reads low)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the peak may read low after the first update
        pass


def timed_update(worker, state: dict, batch: TokenBatch) -> dict:
    """The update of a step (log-prob pass + PPO update) from ``state``: wall and CPU seconds, and
    the peak resident set above the one before it (``harness.PeakMemory``: VmHWM, reset first)."""
    worker.model.load_state_dict(state)
    worker.optimizer.state.clear()
    _malloc_trim()
    memory = PeakMemory("cpu")
    memory.start()
    wall, cpu = time.perf_counter(), time.process_time()
    logprobs, entropy = worker.compute_logprobs(batch)
    metrics = worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "peak_bytes": memory.peak(),
            "positions": metrics["positions"], "position_ratio": metrics["position_ratio"], "loss": metrics["loss"]}


def gradients(worker, state: dict, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Log-probs, entropies and the first optimizer step's gradients (captured before the step)."""
    worker.model.load_state_dict(state)
    worker.optimizer.state.clear()
    logprobs, entropy = worker.compute_logprobs(batch)
    grads = {}

    def capture(*_):
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in worker.model.named_parameters()})

    handle = worker.optimizer.register_step_pre_hook(capture)
    try:
        worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    finally:
        handle.remove()
    return logprobs, entropy, grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def compare(path: str, repeats: int, overrides: dict, limit: int | None, paper_scale: float | None = None,
            seed: int = 0, info: dict | None = None) -> list[dict]:
    """Rows of each batch, each written to the results as soon as it is measured."""
    data, batches = load_batches(path)
    batches = batches[:limit] if limit else batches
    name = Path(path).stem
    if paper_scale:  # paper-shaped groups, lengths scaled down to what the job's tiny model runs here
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(data["model_dir"]).vocab_size
        scale = lambda lo, hi: (max(1, int(lo * paper_scale)), max(2, int(hi * paper_scale)))  # noqa: E731
        batches = [paper_batch(branch_fractions(data), 2, 12, 6, scale(200, 2000), scale(500, 6192), seed + i, vocab)
                   for i in range(limit or 1)]
        name = f"paper-shaped x{paper_scale} (2 prompts, k=12)"
    rows_worker, tree_worker = make_worker(data, False, overrides), make_worker(data, True, overrides)
    state = copy.deepcopy(rows_worker.model.state_dict())
    out = []
    for index, batch in enumerate(batches):
        lp_r, ent_r, g_r = gradients(rows_worker, state, batch)
        lp_t, ent_t, g_t = gradients(tree_worker, state, batch)
        equality = {"logprobs_rel": relative(lp_t, lp_r), "entropy_rel": relative(ent_t, ent_r),
                    "grad_rel_max": max(relative(g_t[n], g_r[n]) for n in g_r)}
        samples = {"rows": [], "tree": []}
        load_before = os.getloadavg()[0]
        for r in range(repeats):
            order = ("rows", "tree") if r % 2 == 0 else ("tree", "rows")
            for mode in order:
                worker = rows_worker if mode == "rows" else tree_worker
                samples[mode].append(timed_update(worker, state, batch))
        row = {"case": f"{name}[{index}]", "rows": batch.num_rows, "groups": len(group_slices(batch.group_ids)),
               "row_positions": int(batch.lengths.sum()), "repeats": repeats, "load_before": load_before,
               "load_after": os.getloadavg()[0], "overrides": overrides, **equality}
        for mode in ("rows", "tree"):
            for key in ("wall_s", "cpu_s", "peak_bytes"):
                values = [s[key] for s in samples[mode]]
                row[f"{mode}_{key}"] = statistics.median(values)
                row[f"{mode}_{key}_spread"] = [min(values), max(values)]
            row[f"{mode}_positions"] = samples[mode][0]["positions"]
        row["position_ratio"] = samples["tree"][0]["position_ratio"]
        row["speedup"] = row["rows_wall_s"] / row["tree_wall_s"]
        row["threads"] = torch.get_num_threads()
        row["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
        out.append(row)
        write_rows("tree_batches", [row], info)
        print_table([row], ["case", "rows", "position_ratio", "rows_wall_s", "tree_wall_s", "speedup", "rows_cpu_s",
                            "tree_cpu_s", "rows_peak_bytes", "tree_peak_bytes", "grad_rel_max", "load_before",
                            "load_after"])
    return out


# --- paper-shaped batches ------------------------------------------------------------------------

def branch_fractions(data: dict) -> list[float]:
    """Measured branch points: for each branch of the dumped steps, its branch position over its
    parent's response length (where in the parent's response it forked)."""
    fractions = []
    for step in data["steps"]:
        by_key = {(t["group"], i): t for i, t in enumerate(step["trajectories"])}
        groups: dict[int, list[dict]] = {}
        for t in step["trajectories"]:
            groups.setdefault(t["group"], []).append(t)
        for trajs in groups.values():
            for t in trajs:
                if t["kind"] == "branch" and t["branch_position"] and t["parent"] is not None:
                    parent = trajs[t["parent"]] if t["parent"] < len(trajs) else None
                    if parent and parent["response"]:
                        fractions.append(min(1.0, t["branch_position"] / parent["response"]))
        del by_key
    return fractions


def paper_batch(fractions: list[float], prompts: int, k: int, globals_: int, prompt_len: tuple[int, int],
                response_len: tuple[int, int], seed: int, vocab: int = 150_000) -> TokenBatch:
    """A batch shaped like the paper's run (docs/algorithm.md §1, §3): per prompt ``globals_``
    global samples from the bare prompt, the rest branches of a random earlier trajectory forked at
    ``fraction * parent length`` with ``fraction`` drawn from the measured ``fractions``; lengths
    uniform in the given ranges (an assumption: the paper gives the limits, not the spread).
    Token ids are random in ``[10, vocab)``: all that matters is which are shared."""
    from aepo_engine.rollout.trajectory import Trajectory

    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    trajectories = []
    for g in range(prompts):
        prompt, group = tokens(rng.randint(*prompt_len)), []
        for i in range(k):
            traj = Trajectory(prompt_ids=prompt, prompt_index=g, traj_id=i, step=0, kind="global")
            if i >= globals_:
                parent = group[rng.randrange(len(group))]
                cut = int(rng.choice(fractions) * len(parent.response_ids))
                traj.kind, traj.parent_id, traj.branch_position = "branch", parent.traj_id, cut
                traj.append_model_segment(parent.response_ids[:cut], [-1.0] * cut, [1.0] * cut, 1)
                new = max(1, rng.randint(*response_len) - cut)
            else:
                new = rng.randint(*response_len)
            traj.append_model_segment(tokens(new), [-1.0] * new, [1.0] * new, 1)
            group.append(traj)
        trajectories += group
    advantages = torch.randn(len(trajectories), generator=torch.Generator().manual_seed(seed))
    return TokenBatch.from_trajectories(trajectories, advantages)


def flops(lengths: list[list[int]], params: float, layers: int, heads_dim: int) -> float:
    """FLOPs of an update's passes -- the log-prob pass (one forward) and the PPO update (forward +
    backward, 3 forwards) -- over sequences of positions with the given attention contexts:
    ``2 params`` per position for the matmuls and ``4 d`` per (query, key) pair per layer for QK^T
    and PV (``d = heads x head_dim``), each context = the position's depth + 1."""
    positions = sum(len(c) for c in lengths)
    pairs = sum(sum(c) for c in lengths)
    return 4 * (2 * params * positions + 4 * heads_dim * layers * pairs)


def paper(path: str, prompts: int, k: int, globals_: int, seed: int) -> list[dict]:
    data, _ = load_batches(path)
    fractions = branch_fractions(data)
    batch = paper_batch(fractions, prompts, k, globals_, (200, 2000), (500, 6192), seed)
    forest = build_forest(batch, logprob_keys(batch))
    depth = forest.depth.tolist()
    row_contexts = [[t + 1 for t in range(int(n))] for n in batch.lengths]
    tree_contexts = [[d + 1 for d in depth]]
    # Qwen3-14B: 14.8e9 parameters, 14.0e9 of them in matmuls (all but the input embedding: the
    # untied lm_head computes a row per position in both layouts), 40 layers, 40 x 128 query width.
    rows_flops, tree_flops = (flops(c, 14.0e9, 40, 40 * 128) for c in (row_contexts, tree_contexts))
    row = {"case": f"paper-shaped prompts={prompts} k={k} globals={globals_}", "rows": batch.num_rows,
           "row_positions": int(batch.lengths.sum()), "tree_positions": forest.num_nodes,
           "position_ratio": position_ratio(batch, forest), "branch_fractions": len(fractions),
           "branch_fraction_median": statistics.median(fractions) if fractions else None,
           "flops_rows": rows_flops, "flops_tree": tree_flops, "flop_ratio": tree_flops / rows_flops,
           "predicted_gpu_speedup": rows_flops / tree_flops, "seed": seed}
    print_table([row], ["case", "rows", "row_positions", "tree_positions", "position_ratio", "flop_ratio",
                        "predicted_gpu_speedup"])
    return [row]


def positions(path: str) -> list[dict]:
    """Positions per step of the dumped batches (whole steps as one forest per group)."""
    data, batches = load_batches(path)
    out = []
    for step, batch in zip(data["steps"], batches):
        forest = TreeMicroBatch.build(batch).forest
        out.append({"case": f"{Path(path).stem} step {step['step']}", "rows": batch.num_rows,
                    "row_positions": int(batch.lengths.sum()), "tree_positions": forest.num_nodes,
                    "position_ratio": position_ratio(batch, forest), "branches": step["branches"],
                    "inherited_unshared": forest.inherited_unshared})
    print_table(out, ["case", "rows", "row_positions", "tree_positions", "position_ratio", "branches",
                      "inherited_unshared"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dump")
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p = sub.add_parser("compare")
    p.add_argument("batches")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--micro-batch-max-tokens", type=int, default=None)
    p.add_argument("--paper-scale", type=float, default=None,
                   help="time paper-shaped batches with lengths times this (the dump's model and branch points)")
    p = sub.add_parser("positions")
    p.add_argument("batches")
    p = sub.add_parser("paper")
    p.add_argument("batches")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--k", type=int, default=12)
    p.add_argument("--globals", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args, extra = parser.parse_known_args()
    if args.command == "dump":
        dump(args.run_dir, args.out, args.steps, extra)
        return
    info = {**machine(), "load_1min": os.getloadavg()[0]}
    if args.command == "compare":
        budget = args.micro_batch_max_tokens
        overrides = {} if budget is None else {"micro_batch_max_tokens": budget}
        compare(args.batches, args.repeats, overrides, args.limit, args.paper_scale, info=info)
        return
    elif args.command == "positions":
        rows = positions(args.batches)
    else:
        rows = paper(args.batches, args.prompts, args.k, args.globals, args.seed)
    write_rows("tree_batches", rows, info)


if __name__ == "__main__":
    main()
