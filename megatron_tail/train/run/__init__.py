"""The RL run: the loop and its step (`loop`), what a run holds (`session`), what it tells rank 0's rollout
service (`rollout_plan`; the service is `megatron_tail.rollout.service`), the run directory, stop signals,
TensorBoard, the console, and the `train` CLI (`cli`).

    result = run(load_config("examples/demo/demo.yaml"))
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "Cadence": ".loop",
        "LoopHooks": ".loop",
        "RunResult": ".loop",
        "rl_step": ".loop",
        "run": ".loop",
        "RunSession": ".session",
        "start_rollout": ".rollout_plan",
        "GracefulStop": ".signals",
        "ScalarLog": ".tensorboard",
    },
)
