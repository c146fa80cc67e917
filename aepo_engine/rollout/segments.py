"""What a round asks the backend for each trajectory, and what it makes of the answer
(docs/rollouts.md, step 2): the request for a trajectory's next segment (its token budget, stop
strings, seed and entropy head), and the segments a weight update cuts short
(``GenOutput.finish_reason == "abort"``, asynchronous training), kept and continued from their
prefix under a seed of their own until they end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.protocol import GenOutput, GenRequest
from aepo_engine.rollout.seeds import SAMPLE, derive_seed
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["SegmentRequests", "cut_at_stop"]


def _uid(traj: Trajectory) -> tuple[int, int, int]:
    """A key unique to a trajectory for the scheduler's life (an object id may be reused once freed)."""
    return traj.step, traj.prompt_index, traj.traj_id


def cut_at_stop(output: GenOutput, resumed_at: int, stop_strings: Sequence[str], tokenizer: Any) -> GenOutput:
    """A segment continued after ``resumed_at`` tokens (a cut), ended at the first stop string that
    spans the cut: the backend saw only the tokens after it, so it could not match a stop string
    whose first characters came before (it went on sampling past it; those tokens are dropped)."""
    if resumed_at == 0 or not stop_strings:
        return output
    window = max(len(stop.encode()) for stop in stop_strings) + 1  # tokens decode to >= 1 byte each
    head = list(output.token_ids[max(0, resumed_at - window):resumed_at])
    cut_at = len(tokenizer.decode(head))
    for j in range(resumed_at, min(len(output.token_ids), resumed_at + window)):
        text = tokenizer.decode(head + list(output.token_ids[resumed_at:j + 1]))
        hit = next((stop for stop in stop_strings if 0 <= text.find(stop) < cut_at), None)
        if hit is not None:
            keep = j + 1
            return GenOutput(output.token_ids[:keep], output.logprobs[:keep], output.entropies[:keep], "stop", hit)
    return output


@dataclass
class _Partial:
    """What a segment cut short by a weight update has sampled so far; the next round continues
    it from there."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(self, output: GenOutput, version: int) -> None:
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs
        self.entropies += output.entropies
        self.versions += [version] * len(output.token_ids)


class SegmentRequests:
    """The backend requests of a rollout's trajectories and the segments they return, holding the
    parts of the segments a weight update cut until they are continued.

    Args:
        config: the rollout knobs (token caps, sampling, the entropy head n_e).
        seed: the rollout's root seed (``derive_seed``).
        stop_strings: the strings that end a segment (the tool format's).
        tokenizer: decodes the tokens around a cut (:func:`cut_at_stop`).
    """

    def __init__(self, config: RolloutConfig, seed: int, stop_strings: Sequence[str], tokenizer: Any) -> None:
        self.config = config
        self.seed = seed
        self.stop_strings = tuple(stop_strings)
        self.tokenizer = tokenizer
        self._partial: dict[tuple[int, int, int], _Partial] = {}  # _uid(trajectory) -> its cut segment so far

    def __len__(self) -> int:
        """Segments cut by a weight update and waiting to be continued."""
        return len(self._partial)

    def request(self, traj: Trajectory) -> GenRequest:
        """The request for ``traj``'s next segment, or for the rest of a segment a weight update
        cut (its own seed; the entropy head and the token budget count what was sampled)."""
        cfg = self.config
        partial = self._partial.get(_uid(traj))
        done = partial.token_ids if partial is not None else []
        remaining = cfg.max_response_tokens - len(traj.response_ids)
        seed = derive_seed(self.seed, traj.step, traj.prompt_index, traj.traj_id, len(traj.segments),
                           SAMPLE, resumed_at=len(done))
        return GenRequest(prompt_ids=tuple(traj.prompt_ids) + tuple(traj.response_ids) + tuple(done),
                          max_new_tokens=min(cfg.max_tokens_per_segment, remaining) - len(done),
                          stop_strings=self.stop_strings, seed=seed,
                          temperature=cfg.temperature, top_p=cfg.top_p,
                          entropy_tokens=max(cfg.n_entropy_tokens - len(done), 0))

    def complete(self, traj: Trajectory, output: GenOutput, version: int) -> tuple[GenOutput | None, list[int]]:
        """``(output, per-token versions)`` of a finished segment, the tokens of its cut parts first
        (``version``: that of the weights that sampled ``output``); ``(None, [])`` when it was cut
        (again) by a weight update: kept for the next round."""
        partial = self._partial.pop(_uid(traj), None)
        if partial is None and output.finish_reason != "abort":
            return output, [version] * len(output.token_ids)
        partial = partial or _Partial()
        resumed_at = len(partial.token_ids)
        partial.add(output, version)
        merged = GenOutput(partial.token_ids, partial.logprobs, partial.entropies, output.finish_reason,
                           output.stop_string)  # text "": the tool-call reader decodes the whole segment
        merged = cut_at_stop(merged, resumed_at, self.stop_strings, self.tokenizer)
        if merged.finish_reason == "abort":
            self._partial[_uid(traj)] = partial
            return None, []
        return merged, partial.versions[:len(merged.token_ids)]

    def drop(self, traj: Trajectory) -> None:
        """Forget the cut segment of a discarded trajectory, if any."""
        self._partial.pop(_uid(traj), None)

    def forget(self, prompts: set[tuple[int, int]]) -> None:
        """Forget the cut segments of these prompts' (``(step, prompt index)``) trajectories: they
        have returned, so what is still cut belongs to discarded trajectories."""
        self._partial = {uid: part for uid, part in self._partial.items() if uid[:2] not in prompts}
