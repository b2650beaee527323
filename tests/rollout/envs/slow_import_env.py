"""An environment whose module takes `MT_TEST_ENV_IMPORT_S` seconds to import (a heavy SDK's), for the
worker-start tests of `test_env_workers.py`."""

from __future__ import annotations

import os
import time

from megatron_tail.rollout.envs.base import Environment, StepResult

time.sleep(float(os.environ.get("MT_TEST_ENV_IMPORT_S", "0")))


class SlowImport(Environment):
    """Ends at its first step."""

    def step(self, turn):  # noqa: ARG002
        return StepResult(None, done=True)
