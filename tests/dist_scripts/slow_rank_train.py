"""``python -m aepo_engine.train ARGS`` with rank 1's rollouts delayed by ``AEPO_TEST_ROLLOUT_DELAY_S``
seconds (before each step's sampling), as a rank whose agentic rollouts take longer than the others'.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_scripts/slow_rank_train.py ARGS
"""
from __future__ import annotations

import os
import time

from aepo_engine import distributed, step_source, train

if int(os.environ.get("RANK", "0")) == 1:
    delay = float(os.environ["AEPO_TEST_ROLLOUT_DELAY_S"])
    collect = step_source.SynchronousSource.collect

    def slow_collect(self, step):
        time.sleep(delay)
        return collect(self, step)

    step_source.SynchronousSource.collect = slow_collect

if __name__ == "__main__":
    distributed.run_and_exit(train.main)
