"""Preflight planner: memory per trainer GPU and per rollout server, checkpoint size, from a run config and
the model's `config.json` alone (no weights, no data, no GPU, no megatron import).

    plan = make_plan(load_config("examples/qwen3_8b_grpo_dvp.yaml"), Cluster(nodes=2))
    print(format_plan(plan)); plan.fits

`megatron-tail plan CONFIG` is the command line (`plan.cli`); `slurm/rl.sbatch` runs it before it starts
anything.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "Cluster": ".planner",
        "Plan": ".planner",
        "make_plan": ".planner",
        "format_plan": ".report",
        "plan_json": ".report",
        "ModelShape": ".shapes",
        "layer_activation_terms": ".activations",
    },
)
