"""The per-step sample dump (``<logging.dir>/samples/step_NNNNNN.jsonl``): its rows, written and read.

One JSON object per line, one line per dumped trajectory. Which trajectories: the step's first
``logging.sample_trajectories`` ones, and every trajectory of the step's first
``logging.sample_trees`` prompts (their whole rollout trees), each once, in (prompt, id) order.

Fields (format 2; format 1, written before the trees existed, had only those marked *):
    prompt_index*, traj_id*, kind* ("probe" | "global" | "branch"), parent_id* (None for roots),
    reward*, finish_reason*, tool_calls* (count), prompt*, response* (decoded text);
    format: 2; step; correct; answer: the answer the reward read (None: none);
    whole_tree: True when every trajectory of this prompt at this step is in the file;
    group_size: the prompt's trajectory count at this step (k);
    branch_position: for a branch, the token index in the parent's response where it forked
        (the length of the copied prefix, which ends with a tool result), else None;
    branch_tool_step: for a branch, the tool results in that prefix (it reacts to the next one
        itself: its first own segment follows tool result ``branch_tool_step``), else None;
    inherited_branches: l at birth for a branch (the parent's consecutive branch count), else None;
    depth: branchings in the lineage (:func:`aepo_engine.rollout.measures.tree_depths`);
    segments: ``[[kind, start, end], ...]`` spans of the response ("model" | "tool");
    head_entropies: ``[H_0, H_1, ...]``: the mean entropy of the first n_e tokens of each model
        segment; H_0 = H_init (from the prompt), H_j is measured after tool result j (a branch's
        list starts with its parent's, copied with the prefix);
    decisions: the branch decisions this trajectory took itself, one per tool result it received:
        ``{tool_step, h_init, h_now, alpha (the base probability drawn), consecutive_branches,
        probability (P), branched, budget_blocked}``;
    tool_log: ``[{tool, payload, ok}, ...]`` the executed calls (inherited prefix included);
    response_tokens, model_tokens: lengths of the response and of its model-written part.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from aepo_engine.rollout.measures import tree_depths
from aepo_engine.rollout.trajectory import Trajectory

FORMAT = 2
TREE_FIELDS = ("format", "whole_tree", "group_size", "branch_position", "branch_tool_step", "head_entropies",
               "decisions", "segments", "depth")
"""What a tree renderer needs beyond format 1 (checked by :func:`read_sample_rows` with ``trees=True``)."""


def sample_rows(trajectories: Sequence[Trajectory], rewards: Sequence[float], correct: Sequence[bool],
                answers: Sequence[Any], tokenizer: Any, count: int, trees: int) -> list[dict[str, Any]]:
    """The rows to dump for one step (module docstring).

    Args:
        trajectories: the step's trajectories, grouped by prompt and sorted by id within a prompt.
        rewards, correct, answers: per trajectory (same order).
        tokenizer: decodes prompt and response ids.
        count: ``logging.sample_trajectories``; trees: ``logging.sample_trees``.
    Returns:
        Format-2 rows, each trajectory at most once, in (prompt_index, traj_id) order.
    """
    if not len(trajectories) == len(rewards) == len(correct) == len(answers):
        raise ValueError("trajectories, rewards, correct and answers must be aligned")
    sizes: dict[int, int] = {}
    for traj in trajectories:
        sizes[traj.prompt_index] = sizes.get(traj.prompt_index, 0) + 1
    tree_prompts = set(sorted(sizes)[:trees])
    chosen = [i for i, t in enumerate(trajectories) if i < count or t.prompt_index in tree_prompts]
    depths = tree_depths(trajectories)
    return [_row(trajectories[i], rewards[i], correct[i], answers[i], tokenizer,
                 whole_tree=trajectories[i].prompt_index in tree_prompts, group_size=sizes[trajectories[i].prompt_index],
                 depth=depths[(trajectories[i].prompt_index, trajectories[i].traj_id)]) for i in chosen]


def _row(t: Trajectory, reward: float, correct: bool, answer: Any, tokenizer: Any, *, whole_tree: bool,
         group_size: int, depth: int) -> dict[str, Any]:
    return {
        "prompt_index": t.prompt_index, "traj_id": t.traj_id, "kind": t.kind, "parent_id": t.parent_id,
        "reward": float(reward), "finish_reason": t.finish_reason, "tool_calls": t.tool_calls,
        "prompt": tokenizer.decode(t.prompt_ids), "response": tokenizer.decode(t.response_ids),
        "format": FORMAT, "step": t.step, "correct": bool(correct), "answer": None if answer is None else str(answer),
        "whole_tree": whole_tree, "group_size": group_size,
        "branch_position": t.branch_position, "branch_tool_step": t.branch_tool_step,
        "inherited_branches": t.inherited_branches, "depth": depth,
        "segments": [[s.kind, s.start, s.end] for s in t.segments],
        "head_entropies": [float(h) for h in t.segment_entropies],
        "decisions": [dataclasses.asdict(d) for d in t.decisions],
        "tool_log": [{"tool": c.tool, "payload": c.payload, "ok": c.ok} for c in t.tool_log],
        "response_tokens": len(t.response_ids), "model_tokens": sum(t.loss_mask),
    }


# ---------------------------------------------------------------------------------------------
# Reading


class SampleDumpError(ValueError):
    """A sample dump that is missing, unreadable, or too old for what is asked of it."""


def sample_path(samples_dir: str | Path, step: int) -> Path:
    """``samples_dir/step_NNNNNN.jsonl`` (how :class:`aepo_engine.metrics.RunLogger` names them)."""
    return Path(samples_dir) / f"step_{step:06d}.jsonl"


def read_sample_rows(path: str | Path, trees: bool = False) -> list[dict[str, Any]]:
    """The rows of one step's dump.

    Args:
        path: a ``step_NNNNNN.jsonl`` file.
        trees: require the format-2 tree fields (:data:`TREE_FIELDS`) on every row.
    Raises:
        SampleDumpError: the file is missing or empty, a line is not a JSON object (with its line
            number), or ``trees`` and a row lacks tree fields (a format-1 dump, written before
            them: says so).
    """
    path = Path(path)
    if not path.is_file():
        raise SampleDumpError(f"no sample dump at {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SampleDumpError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not {"prompt_index", "traj_id", "kind"} <= row.keys():
            raise SampleDumpError(f"{path}:{number}: not a sample row (needs prompt_index, traj_id, kind)")
        if trees:
            missing = [f for f in TREE_FIELDS if f not in row]
            if missing:
                raise SampleDumpError(
                    f"{path}:{number}: row has no {', '.join(missing)}: a format-{row.get('format', 1)} dump "
                    f"(written before the rollout trees were dumped); re-run with this version and "
                    f"logging.sample_trees > 0")
        rows.append(row)
    if not rows:
        raise SampleDumpError(f"{path}: empty (logging.sample_trajectories = logging.sample_trees = 0?)")
    return rows
