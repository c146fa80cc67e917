"""Agent functions: load one, and run episodes of it against the gateway.

An agent is ``async def run(task, client) -> reward``: ``task`` is what the engine hands it (a
dict: the question, the prompt's messages, the ground truth and the example's metadata), and
``client`` an ``openai.AsyncOpenAI`` whose base URL is the episode's own session of the gateway.
It returns the episode's reward: a number, or ``{"reward": number, "correct": bool}``; it may
instead post the reward to the session (``POST {base_url without /v1}/reward``) and return None.

An agent can also be a program in any language (:func:`command_agent`, ``agent.command``).

An agent that raises, returns something else or runs past ``timeout_s`` ends its episode as a
failure (:attr:`Episode.error`, counted as ``agent/failed_episodes``): never the run.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from aepo_engine.gateway.conversation import Session

__all__ = ["AgentFunction", "Episode", "EpisodeRunner", "command_agent", "load_agent", "run_episodes"]

AgentFunction = Callable[[Any, Any], Awaitable[Any]]


def load_agent(spec: str) -> AgentFunction:
    """The agent function ``spec`` names: ``"package.module:function"`` or
    ``"path/to/file.py:function"``.

    Raises:
        ValueError: a spec without ``:``, a module or file that cannot be imported, no such
            attribute, or one that is not an ``async def`` function.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"agent.function must be 'module:function' or 'file.py:function', got {spec!r}")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"agent.function: no file {str(path)!r}")
        module_spec = importlib.util.spec_from_file_location(f"aepo_agent_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the agent's own import error, said in one line
            raise ValueError(f"agent.function: importing {str(path)!r} failed ({type(exc).__name__}: {exc})") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(f"agent.function: cannot import {where!r} ({exc})") from None
    function = getattr(module, name, None)
    if function is None:
        raise ValueError(f"agent.function: {where!r} has no {name!r}")
    if not inspect.iscoroutinefunction(function):
        raise ValueError(f"agent.function: {spec!r} must be an `async def run(task, client)` function")
    return function


def command_agent(command: str, model_name: str = "policy") -> AgentFunction:
    """An agent that is a program: ``command`` run by the shell once per episode, with
    ``OPENAI_BASE_URL`` (the episode's session), ``OPENAI_API_KEY`` (the run's token),
    ``AEPO_MODEL`` (the model name to ask for; the ``openai`` clients of most languages read the
    first two by themselves) and ``AEPO_TASK`` (the task as JSON) in its environment. Its reward is
    the last line it prints to stdout (a number, or ``{"reward": number, "correct": bool}``), or
    one it posted to the session; a non-zero exit status is a failure (with its stderr's tail)."""
    import json
    import os

    async def run(task: Any, client: Any) -> Any:
        env = {**os.environ, "OPENAI_BASE_URL": str(client.base_url), "OPENAI_API_KEY": client.api_key,
               "AEPO_MODEL": model_name, "AEPO_TASK": json.dumps(task, default=str)}
        proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE, env=env)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:  # the episode's timeout: the program goes too
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"agent.command exited with status {proc.returncode}: "
                               f"{err.decode(errors='replace').strip()[-300:]}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            raise RuntimeError(f"agent.command's last line is not a number or JSON: {lines[-1][:200]!r}") from None

    return run


@dataclass
class Episode:
    """One agent episode.

    Attributes:
        session: its gateway session (the recording).
        reward: the reward returned or posted (None: a failure, or none given).
        correct: whether the agent said the answer was correct (None: it did not say).
        error: why it failed (None: it did not).
        seconds: wall-clock time of the episode.
    """

    session: Session
    reward: float | None = None
    correct: bool | None = None
    error: str | None = None
    seconds: float = 0.0


def _reward_of(value: Any, session: Session) -> tuple[float | None, bool | None, str | None]:
    """``(reward, correct, error)`` from what the agent returned (or posted)."""
    correct = None
    if isinstance(value, dict):
        correct = value.get("correct")
        value = value.get("reward")
        if correct is not None and not isinstance(correct, bool):
            return None, None, f"'correct' must be a bool, got {type(correct).__name__}"
    if value is None:
        value = session.reward
    if value is None:
        return None, None, "the agent returned no reward and posted none"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, None, f"the reward must be a finite number, got {value!r}"
    return float(value), correct, None


async def _episode(agent: AgentFunction, task: Any, session: Session, base_url: str, token: str,
                   timeout_s: float, gate: asyncio.Semaphore) -> Episode:
    import openai

    async with gate:
        t0 = time.perf_counter()
        client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=timeout_s)
        episode = Episode(session)
        try:
            value = await asyncio.wait_for(agent(task, client), timeout_s)
            episode.reward, episode.correct, episode.error = _reward_of(value, session)
        except asyncio.TimeoutError:
            episode.error = f"the agent ran past agent.timeout_s ({timeout_s:g} s)"
        except Exception as exc:  # noqa: BLE001 - an agent's failure ends its episode, never the run
            episode.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - closing a client cannot fail the episode
                pass
        episode.seconds = time.perf_counter() - t0
        return episode


class EpisodeRunner:
    """Runs agent episodes against a gateway, at most ``concurrency`` at a time (0: no limit),
    each against a session of its own; more can be started while they run (:meth:`spawn`: a
    branch, from the gateway's thread; ``on_end``: a fresh episode when one ends).

    Args:
        gateway: the :class:`~aepo_engine.gateway.server.Gateway`.
        agent: the agent function.
        timeout_s: an episode's time limit.
        concurrency: episodes at once (0: all).
    """

    def __init__(self, gateway: Any, agent: AgentFunction, timeout_s: float, concurrency: int = 0):
        self.gateway, self.agent, self.timeout_s, self.concurrency = gateway, agent, timeout_s, concurrency
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, episodes: Sequence[tuple[Any, dict[str, Any]]],
            on_end: Callable[[Episode], None] | None = None) -> list[Episode]:
        """Run one episode per ``(task, session_fields)`` (``gateway.open_session(**fields)``) and
        every one started meanwhile; all of them, in the order they ended."""
        self._on_end, self._done, self._tasks = on_end, [], set()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._gate = asyncio.Semaphore(self.concurrency if self.concurrency > 0 else 1 << 30)
            for task, fields in episodes:
                self.start(self.gateway.open_session(task=task, **fields))
            while self._tasks:  # episodes started while others run join the wait
                await asyncio.wait(list(self._tasks))

        try:
            asyncio.run(main())
        finally:
            self._loop = None
        return self._done

    def start(self, session: Session) -> None:
        """Start an episode on ``session`` (in the runner's loop)."""
        gateway = self.gateway
        task = self._loop.create_task(_episode(self.agent, session.task, session, gateway.base_url(session),
                                               gateway.token, self.timeout_s, self._gate))
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def spawn(self, session: Session) -> None:
        """Serve ``session`` and start an episode on it; from any thread while :meth:`run` runs."""
        self.gateway.add_session(session)
        self._loop.call_soon_threadsafe(self.start, session)

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        episode = task.result()
        self.gateway.close_session(episode.session)
        self._done.append(episode)
        if self._on_end is not None:
            self._on_end(episode)


def run_episodes(gateway: Any, agent: AgentFunction, episodes: Sequence[tuple[Any, dict[str, Any]]],
                 timeout_s: float, concurrency: int = 0) -> list[Episode]:
    """Run ``agent`` once per ``(task, session_fields)`` of ``episodes``, at most ``concurrency``
    at a time (0: all at once), each against a session of its own (``gateway.open_session(**
    session_fields)``, closed after); the episodes in the order given."""
    done = EpisodeRunner(gateway, agent, timeout_s, concurrency).run(episodes)
    order = {id(task): i for i, (task, _) in enumerate(episodes)}
    return sorted(done, key=lambda e: (order.get(id(e.session.task), len(order)), e.session.traj_id))
