"""`megatron-tail train` with a tiny Qwen3-MoE, `algorithm.routing_replay=r3` and multi-turn episodes
(`rollout.env.name`) on the local engine: no longer refused; the episodes carry their turns' routes, the
trainer replays them, two steps complete with several turns per episode and `moe/routing_agreement` in
range."""

from __future__ import annotations

import math

import torch

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import train_with_torchrun


def _chatty_moe(path):
    """The tiny Qwen3-MoE with EOS made likely (its output row along the mean final hidden state), so turns
    end by "stop" and episodes go on to the environment's next turn instead of ending at max_new_tokens."""
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from tests.rollout.tiny_moe import write_tiny_qwen3_moe

    write_tiny_qwen3_moe(path)
    model = Qwen3MoeForCausalLM.from_pretrained(str(path))
    eos = AutoTokenizer.from_pretrained(str(path)).eos_token_id
    with torch.no_grad():
        h = model.model(torch.randint(4, 100, (32, 16))).last_hidden_state.reshape(
            -1, model.config.hidden_size
        )
        m = h.mean(0)
        model.lm_head.weight[eos] = 3.0 * m / m.dot(m)
    model.save_pretrained(str(path))
    return path


def test_r3_with_episodes_trains_and_replays_the_episodes_routes(prompt_file, tmp_path):
    model_dir = _chatty_moe(tmp_path / "tiny_moe")
    extra = {
        "parallel.tensor_parallel": 1,
        "train.steps": 2,
        "rollout.max_new_tokens": 6,
        "rollout.env.name": "tests.rollout.envs.fault_envs:ShortObservation",
        "rollout.env.max_turns": 3,
        "rollout.env.max_observation_tokens": 8,
        "algorithm.routing_replay": "r3",
        "algorithm.group_size": 2,
        "data.prompts_per_step": 2,
    }
    proc, run_dir = train_with_torchrun(model_dir, prompt_file, tmp_path, extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["moe/routing_agreement"]] == [1, 2]
    # replayed routes are the engine's: its own router agrees with them on most (token, layer)
    assert all(0.5 < v <= 1.0 for _, v in scalars["moe/routing_agreement"]), scalars["moe/routing_agreement"]
    assert max(v for _, v in scalars["rollout/turns_mean"]) > 1.0  # episodes of several turns
    assert max(v for _, v in scalars["rollout/env_token_fraction"]) > 0.0
    assert all(math.isfinite(v) for _, v in scalars["mismatch/kl_infer_train_k3"])
