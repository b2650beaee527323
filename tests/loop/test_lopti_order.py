"""Lopti updates the whole batch on its low-probability tokens first, then on the rest, also with several
mini-batches: the optimizer steps of one RL step see mb1-low, mb2-low, mb1-high, mb2-high (arXiv
2505.12929 and its authors' trainer), never mb1-low, mb1-high, mb2-low, mb2-high."""

from __future__ import annotations

import math

import torch

from megatron_tail.config import load_config
from tests.harness import run_distributed
from tests.loop.conftest import loop_overrides

ETA = 0.2


def _recording_rank(rank, world, overrides):  # noqa: ARG001
    import megatron_tail.train.rl.update as update
    from megatron_tail.train.run.loop import run

    steps, mini_batch_ids = [], {}
    real_train_step, real_loss_fn = update.train_step, update.rl_loss_fn

    def loss_fn_with_phase(cfg, counts, *, phase=0):
        fn = real_loss_fn(cfg, counts, phase=phase)
        fn.phase = phase
        return fn

    def recording_train_step(trainer, mbs, loss_fn, *, op, **kw):
        seen = []
        for mb in mbs:
            prepared = mb.extras["prepared"]
            current = prepared.phases[loss_fn.phase]
            mask = current.mask & prepared.loss_mask
            seen.append(prepared.old_logprobs[mask].exp())
        probs = torch.cat(seen)
        mini = mini_batch_ids.setdefault(id(mbs), len(mini_batch_ids))
        name = mbs[0].extras["prepared"].phases[loss_fn.phase].name
        low, high = (float(probs.min()), float(probs.max())) if probs.numel() else (math.inf, 0.0)
        steps.append((mini, name, probs.numel(), low, high))
        return real_train_step(trainer, mbs, loss_fn, op=op, **kw)

    update.train_step, update.rl_loss_fn = recording_train_step, loss_fn_with_phase
    run(load_config(None, overrides))
    return steps


def test_lopti_phases_run_over_the_whole_batch_in_order(tiny_model_dir, prompt_file, engine, tmp_path):
    extra = {
        "rollout.engine": "remote",
        "rollout.server_urls": f"[{engine.url}]",
        "algorithm.lopti": "true",
        "algorithm.lopti_eta": ETA,
        "train.mini_batches": 2,
        "train.micro_batch_size": 4,
        "train.steps": 1,
    }
    overrides = loop_overrides(tiny_model_dir, prompt_file, tmp_path / "run", extra)
    for steps in run_distributed(_recording_rank, 2, overrides, timeout=600):
        assert [(mini, name) for mini, name, *_ in steps] == [
            (0, "low"),
            (1, "low"),
            (0, "high"),
            (1, "high"),
        ]
        for _, name, count, low, high in steps:
            assert count > 0, "every optimizer step trains on some tokens in this setup"
            assert (high < ETA) if name == "low" else (low >= ETA), (name, low, high)
