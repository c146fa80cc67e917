"""A step's rollouts from an agent program: ``rollout.k`` episodes per prompt through the gateway.

:class:`AgentRollout` stands where the engine's own scheduler stands in a synchronous run
(``SynchronousSource``'s ``rollout``): ``run_step(examples, step)`` returns the step's
trajectories (each episode's recording, its reward from the agent attached) and their
statistics. An episode that failed (an exception, a timeout, no reward), drifted (its agent
rewrote the conversation: the ids sampled are not the ones it continued) or produced no
completion is left out and counted in :attr:`AgentRollout.last_counts`.

With ``agent.global_samples`` = m < rollout.k, each prompt starts m episodes and AEPO's branch rule
forks the others from them after tool results (:mod:`aepo_engine.gateway.branching`); otherwise
every episode is a global sample.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from aepo_engine.gateway.agents import AgentFunction, EpisodeRunner, run_episodes
from aepo_engine.gateway.branching import AgentBranching
from aepo_engine.gateway.config import AgentConfig
from aepo_engine.rollout.scheduler import RolloutResult
from aepo_engine.rollout.stats import RolloutCounters, rollout_stats

__all__ = ["AgentEvaluation", "AgentRollout", "agent_task", "build_agent_rollout"]


def agent_task(example: Any, corpus_path: str | None = None) -> dict[str, Any]:
    """What an agent is handed for ``example``: its question, the prompt's messages, the ground
    truths, its source tag and metadata, and the search corpus of the run's task (a JSONL path, or
    None) for agents that search it themselves."""
    return {"question": example.question, "messages": example.messages(), "ground_truth": list(example.ground_truth),
            "data_source": example.data_source, "meta": dict(example.meta or {}), "search_corpus": corpus_path}


class AgentRollout:
    """The step's episodes of ``agent`` through ``gateway``.

    Args:
        gateway: the run's :class:`~aepo_engine.gateway.server.Gateway`.
        agent: the agent function.
        config: the ``agent`` section.
        rollout: the (rank's) ``rollout`` section: k episodes per prompt, the branch rule, the seed.
        task_of: an example's task for the agent (:func:`agent_task`).
    """

    def __init__(self, gateway: Any, agent: AgentFunction, config: AgentConfig, rollout: Any,
                 task_of: Callable[[Any], Any]):
        self.gateway, self.agent, self.config, self.rollout, self.task_of = gateway, agent, config, rollout, task_of
        self.k = rollout.k
        self.m = config.global_samples if 0 < config.global_samples < rollout.k else rollout.k
        self.last_counts: dict[str, float] = {}

    def episodes(self, examples: Sequence[Any], step: int, version: int, samples: int) -> list[Any]:
        """``samples`` episodes of each example with the weights at ``version`` (all of them, failures included)."""
        self.gateway.version = version
        plan = [(self.task_of(example), {"prompt_index": i, "traj_id": j, "step": step})
                for i, example in enumerate(examples) for j in range(samples)]
        return run_episodes(self.gateway, self.agent, plan, self.config.timeout_s, self.config.concurrency)

    def branched_episodes(self, examples: Sequence[Any], step: int, version: int) -> list[Any]:
        """``k`` episodes of each example: ``m`` global ones, the rest AEPO's branches (or fresh
        global episodes where no decision took a slot): :mod:`aepo_engine.gateway.branching`."""
        self.gateway.version = version
        runner = EpisodeRunner(self.gateway, self.agent, self.config.timeout_s, self.config.concurrency)
        tasks = [self.task_of(example) for example in examples]

        def fresh(prompt: int, traj_id: int) -> None:
            runner.start(self.gateway.open_session(task=tasks[prompt], prompt_index=prompt, traj_id=traj_id,
                                                   step=step))

        branching = AgentBranching(self.rollout, self.rollout.seed, runner.spawn, fresh)
        for i in range(len(examples)):
            branching.start_prompt(i, self.m)
        self.gateway.on_record = branching
        try:
            done = runner.run([(tasks[i], {"prompt_index": i, "traj_id": j, "step": step})
                               for i in range(len(examples)) for j in range(self.m)],
                              on_end=lambda episode: branching.ended(episode.session))
        finally:
            self.gateway.on_record = None
        self.last_branching = {"agent/branches": float(branching.branches),
                               "agent/fresh_global_samples": float(branching.fresh_samples)}
        return done

    def run_step(self, examples: Sequence[Any], step: int, version: int | None = None) -> RolloutResult:
        """Step ``step``'s trajectories, grouped by prompt and sorted by ``traj_id``."""
        t0 = time.perf_counter()
        version = step if version is None else version
        self.last_branching = {}
        done = (self.branched_episodes(examples, step, version) if self.m < self.k
                else self.episodes(examples, step, version, self.k))
        kept, failed, drifted, diverged, empty = [], 0, 0, 0, 0
        counters = RolloutCounters()
        for episode in done:
            session, traj = episode.session, episode.session.trajectory
            if traj is not None:
                counters.tokens_generated += sum(traj.loss_mask)
                counters.tool_tokens += len(traj.loss_mask) - sum(traj.loss_mask)
                counters.tool_calls_executed += traj.tool_calls
                counters.malformed_calls += traj.malformed_calls
            if episode.error is not None or episode.reward is None:
                failed += 1
            elif session.diverged:
                diverged += 1
            elif session.drifted:
                drifted += 1
            elif traj is None or not traj.segments:
                empty += 1
            else:
                traj.agent_reward, traj.agent_correct = episode.reward, episode.correct
                kept.append(traj)
        counters.rounds = self.gateway.stats.batches
        counters.generate_s = time.perf_counter() - t0
        kept.sort(key=lambda t: (t.prompt_index, t.traj_id))
        self.last_counts = {"agent/episodes": float(len(done)), "agent/failed_episodes": float(failed),
                            "agent/drifted_episodes": float(drifted), "agent/empty_episodes": float(empty),
                            "agent/drift_tokens": float(sum(e.session.drift_tokens for e in done)),
                            "agent/episode_s": sum(e.seconds for e in done) / max(len(done), 1),
                            "rollout/replay_divergence": float(diverged), **self.last_branching}
        m = [self.m] * len(examples)
        stats = rollout_stats(m, [None] * len(examples), [None] * len(examples), kept, counters)
        return RolloutResult(kept, stats)

    def close(self) -> None:
        """Stop the gateway."""
        self.gateway.close()


def build_agent_rollout(agent_cfg: AgentConfig, rollout_cfg: Any, backend: Any, tokenizer: Any, *,
                        corpus_path: str | None, max_prompt_tokens: int, tool_format: str) -> AgentRollout:
    """The run's gateway on ``backend`` (sampling as ``rollout_cfg`` says) and the agent rollout
    through it (``agent_cfg.function`` loaded now: a bad one fails before any step)."""
    from aepo_engine.gateway.agents import command_agent, load_agent
    from aepo_engine.gateway.server import Gateway

    agent = load_agent(agent_cfg.function) if agent_cfg.function else command_agent(agent_cfg.command, agent_cfg.model_name)
    gateway = Gateway(backend, tokenizer, model_name=agent_cfg.model_name,
                      max_tokens=min(rollout_cfg.max_tokens_per_segment, rollout_cfg.max_response_tokens),
                      max_context_tokens=agent_cfg.max_context_tokens or max_prompt_tokens + rollout_cfg.max_response_tokens,
                      temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                      n_entropy_tokens=rollout_cfg.n_entropy_tokens, seed=rollout_cfg.seed,
                      batch_window_s=agent_cfg.batch_window_ms / 1000, port=agent_cfg.port, tool_format=tool_format)
    return AgentRollout(gateway, agent, agent_cfg, rollout_cfg, lambda example: agent_task(example, corpus_path))


class AgentEvaluation:
    """The held-out evaluation of an agent run: each question asked ``samples`` times by the agent
    through the gateway; ``accuracy`` is the mean of the episodes' ``correct`` (the agent's word;
    a reward > 0 where it gave none), failures counting as wrong.

    Args:
        rollout: the run's :class:`AgentRollout` (the held-out questions are asked without branching).
        questions: the held-out examples (the first ``num_questions``; 0: all).
        samples: episodes per question.
        log: where the one-line summary goes.
    """

    def __init__(self, rollout: AgentRollout, questions: Sequence[Any], num_questions: int, samples: int,
                 log: Callable[[str], None]):
        self.rollout, self.samples, self.log = rollout, samples, log
        self.questions = list(questions)[: num_questions or None]

    def __bool__(self) -> bool:
        return bool(self.questions)

    def __call__(self, engine: Any, label: str) -> dict[str, float]:
        t0 = time.perf_counter()
        done = self.rollout.episodes(self.questions, step=-1, version=self.rollout.gateway.version,
                                     samples=self.samples)
        correct = [bool(e.correct if e.correct is not None else (e.reward or 0) > 0) if e.error is None else False
                   for e in done]
        rewards = [e.reward for e in done if e.reward is not None]
        result = {"accuracy": sum(correct) / max(len(correct), 1),
                  "reward": sum(rewards) / max(len(rewards), 1),
                  "failed_share": sum(e.error is not None for e in done) / max(len(done), 1),
                  "tool_calls": sum(e.session.trajectory.tool_calls for e in done if e.session.trajectory)
                  / max(len(done), 1),
                  "questions": float(len(self.questions))}
        self.log(f"[eval {label}] agent: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items())
                 + f" ({time.perf_counter() - t0:.0f}s)")
        return result
