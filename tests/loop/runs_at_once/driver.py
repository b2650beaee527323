"""The experiments' grid (`tail_mismatch.run_grid`) with `--jobs`, one seed per arm, each arm with no
overrides, on stand-ins for what takes minutes: the tail model and its prompts (paths that are not read) and
the training launcher (`launcher.py`, run by the real `supervise.run_training` with the grid's relay).
Arguments: the number of runs at once, the grid's folder, then the arms' names; run `<out>/<arm>/seed0`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_tail.experiments import tail_mismatch
from megatron_tail.train.run import supervise

LAUNCHER = os.path.join(os.path.dirname(__file__), "launcher.py")


def _launch_training(run_dir, _overrides, *, base_yaml, quiet, relay):  # noqa: ARG001 - launch_training's
    return supervise.run_training([], run_dir, env=dict(os.environ), relay=relay)


def main() -> None:
    supervise.training_command = lambda _args, config: [sys.executable, LAUNCHER, str(config)]
    tail_mismatch.launch_training = _launch_training
    tail_mismatch.ensure_tail_model = lambda cache, **_: Path(cache) / "model"
    tail_mismatch.ensure_tail_prompts = lambda cache: (Path(cache) / "prompts.jsonl", None)
    tail_mismatch.reusable_run = lambda *_, **__: False
    jobs, out, names = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    tail_mismatch.run_grid(out, out / "cache", {name: [] for name in names}, seeds=(0,), jobs=jobs)
    print("all runs finished", flush=True)


if __name__ == "__main__":
    main()
