"""One sampled trajectory (token-in/token-out) with its lineage, and the rollout tree of a prompt.

A trajectory is the prompt ids plus a response made of alternating segments: model segments
(sampled tokens, loss mask 1, their sampling log-probs and entropies) and tool-result segments
(``tools.encode_tool_result``: the tool's text as plain text, loss mask 0, log-prob 0, entropy 0). Model tokens are
stored exactly as the backend sampled them; they are never decoded and re-encoded.

Lineage: ``traj_id`` numbers the trajectories of one prompt in creation order; a branch records
its parent, the tool step it branched at and the consecutive-branch count of its lineage.

Policy versions: every model token records the version of the weights that sampled it
(``versions``; the number of updates those weights had). In synchronous training all of a
trajectory's tokens have one version; in asynchronous training a trajectory in flight at a weight
update goes on under the new weights, so its tokens carry several, and a branch inherits its
parent's prefix with the prefix's versions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Sequence

TrajectoryKind = Literal["probe", "global", "branch"]
"""probe: the pre-monitoring trajectory kept as a sample; global: sampled from the bare prompt;
branch: copied from a parent after a tool result."""

TrajectoryFinish = Literal["eos", "length", "stop", "tool_limit", "malformed"]
"""eos: the model ended; length: a token cap was hit; stop: a stop string without a tool call;
tool_limit: a call beyond ``max_tool_calls``; malformed: an empty or broken tool call."""


class Segment(NamedTuple):
    """A span ``response_ids[start:end]`` produced by the model or by a tool."""

    kind: Literal["model", "tool"]
    start: int
    end: int


@dataclass(frozen=True)
class ToolCallRecord:
    """One executed tool call of a trajectory, for logs and evaluation reports.

    Args:
        tool: the tool name (tag); payload: the text between its tags.
        result: the result text shown to the model (before token truncation).
        ok: False when the call failed; elapsed_s: the call's wall-clock seconds.
    """

    tool: str
    payload: str
    result: str
    ok: bool
    elapsed_s: float


@dataclass(frozen=True)
class BranchDecision:
    """One branching decision, taken after the segment that reacts to a tool result (docs/algorithm.md §1c).

    Args:
        tool_step: number of tool results in the trajectory when the decision was taken.
        h_init: entropy of the trajectory's first segment (its own, this rollout step).
        h_now: entropy of the first n_e tokens of the segment reacting to the latest result.
        alpha: base probability used (drawn or constant).
        consecutive_branches: l, this lineage's consecutive branching steps before deciding.
        probability: P = (alpha + gamma * (h_now - h_init)) * (1 - Phat(l)).
        branched: True when a child was created (P > tau and budget left).
        budget_blocked: True when P > tau but the prompt had no budget left.
    """

    tool_step: int
    h_init: float
    h_now: float
    alpha: float
    consecutive_branches: int
    probability: float
    branched: bool
    budget_blocked: bool


def mean_head_entropy(entropies: Sequence[float], n_tokens: int) -> float:
    """Mean entropy of the first ``n_tokens`` positions (0.0 for an empty segment)."""
    head = entropies[:n_tokens]
    return float(sum(head) / len(head)) if head else 0.0


@dataclass(eq=False)  # a trajectory is a mutable record: identity, not field equality
class Trajectory:
    """A prompt's sampled response with masks, log-probs, entropies and lineage.

    Token-aligned lists (all ``len(response_ids)`` long): ``loss_mask`` (1 model token, 0 tool
    token), ``logprobs`` (sampling log-prob; 0.0 on tool tokens), ``versions`` (the policy version
    that sampled the token; -1 on tool tokens), ``entropies`` (per-token
    sampling entropy; 0.0 on tool tokens; NaN past a segment's head where the backend estimates
    entropies only there, see ``GenRequest.entropy_tokens``). ``segment_entropies[j]`` is the mean entropy of the
    first n_e tokens of the j-th *model* segment; ``segment_entropies[0]`` is H_init.
    ``tool_calls`` counts executed calls (= tool-result segments, inherited prefix included);
    ``tool_log`` records each executed call (tool, payload, result, latency), inherited prefix included;
    ``decisions`` lists the branch decisions this trajectory took itself.
    ``agent_reward`` / ``agent_correct``: an agent program's episode (``aepo_engine.gateway``):
    the reward and correctness its agent reported, which score it instead of the run's reward rules.
    """

    prompt_ids: list[int]
    prompt_index: int
    traj_id: int
    step: int
    kind: TrajectoryKind
    parent_id: int | None = None
    branch_tool_step: int | None = None  # tool results in the prefix copied from the parent
    branch_position: int | None = None   # len(response_ids) of the copied prefix
    consecutive_branches: int = 0        # l: consecutive branching steps of this lineage (live)
    inherited_branches: int | None = None  # l at birth for a branch (parent's count + 1)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    segment_entropies: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_log: list[ToolCallRecord] = field(default_factory=list)  # one record per executed call
    malformed_calls: int = 0
    finish_reason: TrajectoryFinish | None = None
    decisions: list[BranchDecision] = field(default_factory=list)
    agent_reward: float | None = None
    agent_correct: bool | None = None

    @property
    def uid(self) -> str:
        """Globally readable id: ``step<step>/p<prompt_index>/t<traj_id>``."""
        return f"step{self.step}/p{self.prompt_index}/t{self.traj_id}"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def h_init(self) -> float | None:
        """Entropy of the first segment (from the prompt); None before it is generated."""
        return self.segment_entropies[0] if self.segment_entropies else None

    @property
    def num_tool_results(self) -> int:
        return sum(segment.kind == "tool" for segment in self.segments)

    def append_model_segment(self, token_ids: Sequence[int], logprobs: Sequence[float],
                             entropies: Sequence[float], n_entropy_tokens: int,
                             versions: int | Sequence[int] = 0) -> None:
        """Append sampled tokens (mask 1) and record the segment's head entropy; ``versions``: the
        policy version of every token, or one for all."""
        versions = [versions] * len(token_ids) if isinstance(versions, int) else list(versions)
        if not len(token_ids) == len(logprobs) == len(entropies) == len(versions):
            raise ValueError(f"backend output misaligned: {len(token_ids)} tokens, "
                             f"{len(logprobs)} logprobs, {len(entropies)} entropies, {len(versions)} versions")
        self._append("model", token_ids, 1, logprobs, entropies, versions)
        self.segment_entropies.append(mean_head_entropy(entropies, n_entropy_tokens))

    def append_tool_result(self, token_ids: Sequence[int]) -> None:
        """Append tool-result tokens: loss mask 0, log-prob 0, entropy 0, version -1."""
        zeros = [0.0] * len(token_ids)
        self._append("tool", token_ids, 0, zeros, zeros, [-1] * len(token_ids))

    def _append(self, kind, token_ids, mask_value, logprobs, entropies, versions) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([mask_value] * len(token_ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.entropies.extend(float(x) for x in entropies)
        self.versions.extend(int(v) for v in versions)
        self.segments.append(Segment(kind, start, len(self.response_ids)))

    def fork(self, at_segment: int, traj_id: int) -> "Trajectory":
        """A branch child: a copy of ``segments[:at_segment]``, which must end with a tool result.

        The child keeps the tool result and samples its own reaction to it. Its tool-call count is
        the number of results in the prefix (a malformed call always ends a trajectory, so a
        prefix holds none); its consecutive-branch count is the parent's current one.
        """
        if not (1 <= at_segment <= len(self.segments)
                and self.segments[at_segment - 1].kind == "tool"):
            raise ValueError(f"{self.uid}: a branch point must follow a tool result "
                             f"(segment {at_segment} of {len(self.segments)})")
        prefix = self.segments[:at_segment]
        cut = prefix[-1].end
        n_model = sum(s.kind == "model" for s in prefix)
        n_tool = len(prefix) - n_model
        return Trajectory(
            prompt_ids=self.prompt_ids, prompt_index=self.prompt_index, traj_id=traj_id,
            step=self.step, kind="branch", parent_id=self.traj_id,
            branch_tool_step=n_tool, branch_position=cut,
            consecutive_branches=self.consecutive_branches,
            inherited_branches=self.consecutive_branches,
            response_ids=self.response_ids[:cut], loss_mask=self.loss_mask[:cut],
            logprobs=self.logprobs[:cut], entropies=self.entropies[:cut], versions=self.versions[:cut],
            segments=list(prefix), segment_entropies=self.segment_entropies[:n_model],
            tool_calls=n_tool, tool_log=self.tool_log[:n_tool],
        )


def decode_response(traj: Trajectory, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The response text and where the engine put each tool result in it.

    Decoded segment by segment, so that the spans are the engine's record of what the tools
    wrote (rewards read results there, not where the text holds result tags: a tool that prints
    ``</result>`` cannot end its block, ``tools.framing``).

    Args:
        traj: a trajectory.
        tokenizer: its tokenizer (``decode``).

    Returns:
        ``(text, tool_spans)``: the concatenated decoded segments, and ``(start, end)`` character
        offsets of each tool segment in it, in order.
    """
    parts, spans, pos = [], [], 0
    for segment in traj.segments:
        piece = tokenizer.decode(traj.response_ids[segment.start:segment.end])
        if segment.kind == "tool":
            spans.append((pos, pos + len(piece)))
        parts.append(piece)
        pos += len(piece)
    return "".join(parts), spans


def reward_view(trajectory: Trajectory, tool_format: Any) -> tuple[str, list[tuple[int, int]]]:
    """The response as the reward reads it, in the tag format whatever the trajectory's format,
    with the character spans of the tool results in it (:func:`decode_response`'s contract:
    rewards read results where the engine put them).

    Tags (``tools.formats.TagFormat``): :func:`decode_response`. Chat template: each call
    rewritten as ``<tool> payload</tool>`` followed by its result as the tag format's result
    block, so the task's reward (format checks, tool bonus, answer) applies unchanged. A
    trajectory that ended on a malformed call ends with an unclosed call tag, which the reward
    penalizes as it does a broken tag call.
    """
    from aepo_engine.tools.formats import TagFormat, trajectory_turns
    from aepo_engine.tools.framing import format_tool_result

    if isinstance(tool_format, TagFormat):
        return decode_response(trajectory, tool_format.tokenizer)
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for turn in trajectory_turns(trajectory, tool_format):
        text, call = turn["text"], turn.get("call")
        if call is None:
            parts.append(text)
            pos += len(text)
            continue
        start = tool_format.call_start(text)
        head = text[:max(start, 0)] + f"<{call.tool}> {call.payload}</{call.tool}>"
        block = format_tool_result(turn["result"], tool_format.tool_names)
        parts += [head, block]
        spans.append((pos + len(head), pos + len(head) + len(block)))
        pos += len(head) + len(block)
    if trajectory.finish_reason == "malformed":
        parts.append(f" <{tool_format.tool_names[0] if tool_format.tool_names else 'search'}>")
    return "".join(parts), spans


# ---------------------------------------------------------------------------------------------
# Rollout tree


def rollout_tree(trajectories: Sequence[Trajectory], prompt_index: int
                 ) -> dict[int | None, list[Trajectory]]:
    """Children of each trajectory of one prompt, keyed by parent id (None: the roots).

    Args:
        trajectories: any rollout output (several prompts may be mixed).
        prompt_index: the prompt whose tree to build.

    Returns:
        parent id -> its children sorted by ``traj_id``. A branch whose parent is not in
        ``trajectories`` (e.g. a discarded probe) is listed under None.
    """
    own = sorted((t for t in trajectories if t.prompt_index == prompt_index),
                 key=lambda t: t.traj_id)
    ids = {t.traj_id for t in own}
    children: dict[int | None, list[Trajectory]] = {None: []}
    for traj in own:
        parent = traj.parent_id if traj.parent_id in ids else None
        children.setdefault(parent, []).append(traj)
    return children


def format_rollout_tree(trajectories: Sequence[Trajectory], prompt_index: int) -> str:
    """Render the rollout tree of one prompt as indented text, one line per trajectory."""
    children = rollout_tree(trajectories, prompt_index)
    count = sum(len(v) for v in children.values())
    lines = [f"prompt {prompt_index}: {count} trajectories"]

    def visit(traj: Trajectory, depth: int) -> None:
        lines.append("  " * depth + "- " + _describe(traj))
        for child in children.get(traj.traj_id, []):
            visit(child, depth + 1)

    for root in children[None]:
        visit(root, 1)
    return "\n".join(lines)


def _describe(traj: Trajectory) -> str:
    where = ""
    if traj.kind == "branch":
        where = (f" from t{traj.parent_id} after tool {traj.branch_tool_step}, "
                 f"born with l={traj.inherited_branches}")
    h_init = "-" if traj.h_init is None else f"{traj.h_init:.3f}"
    return (f"t{traj.traj_id} [{traj.kind}{where}] {len(traj.response_ids)} tokens "
            f"({sum(traj.loss_mask)} model), {traj.tool_calls} tool calls, "
            f"{traj.malformed_calls} malformed, H_init={h_init}, finish={traj.finish_reason}")
