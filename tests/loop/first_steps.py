"""The first steps of small η = 0 / η = 1 runs: each step's batch as the trainer gets it and the step's
training metrics, as JSON (`test_one_generation_path` compares two runs of a case).

    python -m tests.loop.first_steps CASE OUT.json [KEY=VALUE ...] [-- OUT2.json [KEY=VALUE ...] ...]

KEY=VALUE are config overrides on top of the case's. Runs after `--` follow in the same process (a fresh one
for the first: megatron's state), each after the last has torn its own down, as a run in a new process
would start: one start of torch and megatron-core for all of them.

The models are the loop tests' seeded tiny random Qwen3s (`tests/loop/conftest.py`), built beside OUT.json
(in `OUT_run/`, so a test's tmp_path holds them); one process, TP = 1, the local engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CASES = {
    # name: (model, steps, overrides)
    "single_turn_eta0": ("tiny", 2, {}),
    "single_turn_eta1": ("tiny", 2, {"rollout.max_staleness": 1}),
    "agentic_eta0": (
        "chatty",
        2,
        {
            "rollout.env.name": "tests.rollout.envs.fault_envs:ShortObservation",
            "rollout.env.max_turns": 3,
            "rollout.env.max_observation_tokens": 8,
            "rollout.sampling.top_p": 0.95,
            "rollout.sampling.top_k": 20,
            "algorithm.is_mode": "mis",
            "optimizer.lr": 1e-5,
        },
    ),
}

TRAINED_PREFIXES = ("train/", "policy/", "mismatch/", "is/", "reward/", "response/", "dvp/", "loss/")
"""The step metrics that are functions of the batch and the weights (not of timing): at η ≤ 1 the generated
rewards (`reward/generated_*`) too, being those of the groups up to the batch's last prompt
(`RolloutManager._report_done`)."""


def tiny_model(root: Path, chatty: bool) -> Path:
    """`tests/loop/conftest.py`'s `tiny_model_dir` (chatty: `test_multiturn_loop.chatty_model_dir`)."""
    # torch here, not at the top: the run's spawned reward worker imports this module again as its
    # `__mp_main__`, and needs none of it (~2 CPU-s per worker)
    import torch

    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tokenizer = new_tiny_qwen3(
        0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8, max_position_embeddings=32
    )
    if chatty:
        torch.manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
        if chatty:
            h = model.model(torch.randint(4, 100, (64, 20))).last_hidden_state.reshape(-1, 32)
            m = h.mean(0)
            model.lm_head.weight[tokenizer.eos_token_id] = 3.0 * m / m.dot(m)
    return save_hf(model, tokenizer, root / ("chatty" if chatty else "tiny"))


def record(case: str, root: Path, overrides: dict[str, str] | None = None) -> dict:
    """Run `case` (+ `overrides`) in `root`, a new directory; its batches and trained metrics."""
    from megatron_tail.config import load_config
    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples
    from megatron_tail.rollout.columns import LOGPROBS, SUPPORT, VERSIONS
    from megatron_tail.train.run import session as session_module
    from megatron_tail.train.run.loop import LoopHooks, run
    from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides

    model, steps, extra = CASES[case]
    root.mkdir(parents=True)
    prompts = root / "prompts.jsonl"
    rows = make_arithmetic_examples(16, max_digits=2, seed=0)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {
        "parallel.tensor_parallel": 1,
        "train.steps": steps,
        "train.checkpoint_every": 100,
        "logging.tensorboard": False,
        **ENGINE_IN_PROCESS,  # batching is the engine's, whichever way it is served
        **extra,
        **(overrides or {}),
    }
    model_dir = tiny_model(root, model == "chatty")
    cfg = load_config(None, loop_overrides(model_dir, prompts, root / "run", settings))
    batches, metrics = [], []
    original = session_module.RunSession.rollout

    def recording(self, step):
        batch = original(self, step)
        supports = batch.column(SUPPORT)
        batches.append(
            {
                "prompt_ids": batch.prompt_ids,
                "response_ids": batch.response_ids,
                "rollout_logprobs": batch.column(LOGPROBS),
                "rewards": batch.rewards,
                "token_versions": batch.column(VERSIONS),
                "policy_mask": batch.policy_mask,
                "supports": None
                if supports is None
                else [[s.values.tolist(), s.offsets.tolist()] for s in supports],
            }
        )
        return batch

    session_module.RunSession.rollout = recording
    try:
        run(cfg, LoopHooks(on_step_end=lambda _step, m: metrics.append(_trained(m))))
    finally:
        session_module.RunSession.rollout = original
    return {"case": case, "batches": batches, "metrics": metrics}


def _trained(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(metrics.items()) if k.startswith(TRAINED_PREFIXES)}


def main(argv: list[str]) -> None:
    from megatron_tail.patches import import_megatron_deferring_compile
    from megatron_tail.utils.start_up import collector_paused

    with collector_paused():  # as `megatron-tail train` starts (train/run/cli.py)
        import_megatron_deferring_compile()
        import megatron_tail.train.run.loop  # noqa: F401 - imported here, with the collector off
    case, rest = argv[0], " ".join(argv[1:]).split(" -- ")
    for run_args in rest:
        out, *items = run_args.split()
        out = Path(out)
        overrides = dict(item.split("=", 1) for item in items)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record(case, out.parent / f"{out.stem}_run", overrides)))


if __name__ == "__main__":
    main(sys.argv[1:])
