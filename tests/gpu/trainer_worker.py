"""One trainer process of `test_trainer_cuda.py` (run as `python -m tests.gpu.trainer_worker CASE OUT ...`):
two RL steps with DVP + MIS on packed THD micro-batches, the distributed optimizer and full recompute, on
whatever device the process sees (CUDA with NCCL, or CPU with gloo and the CPU patches when
`CUDA_VISIBLE_DEVICES=""`); optionally saves a checkpoint after them and takes a third step, or loads one
and takes that third step. Writes its results to OUT (`torch.save`): per-step metrics, the HF state after
the steps, and a bitwise snapshot of the training state (model, fp32 main parameters, Adam moments, step)
right after a save or a load.

A process of its own per run: megatron's parallel state is global, and the CPU reference must not see CUDA.
"""

from __future__ import annotations

import argparse
import os

import torch

from tests.train.common import full_hf_state

CFG_KW = dict(log_rho=-4.0, is_mode="mis", mis_low=0.5, mis_high=2.0, veto_threshold=1e-4, group_size=2)
"""DVP + MIS (+ the veto). log ρ = −4 prunes on the tiny model's flat logits (test: `safe_mass` < 1); the
case's targets keep a margin from the threshold, so no target changes side between fp32 and bf16."""
MAX_TOKENS = 48
"""Token budget of a packed micro-batch: 16 samples of 6–14 tokens make several THD rows of 3–7 sequences."""


def single_rank_environment() -> None:
    """This process as rank 0 of a world of 1 (torch.distributed's env:// variables, a free port unless
    one is set) with at most 4 torch threads."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from megatron_tail.utils.net import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(min(4, torch.get_num_threads()))


def training_state(trainer) -> dict[str, torch.Tensor]:
    """Every tensor a resume must restore, bitwise, on the host: model parameters (their own dtype) and, per
    inner optimizer, each parameter group's fp32 main parameters and Adam state (`exp_avg`, `exp_avg_sq`,
    `step`), keyed by position."""
    out = {f"model/{n}": p.detach().cpu().clone() for n, p in trainer.chunks[0].named_parameters()}
    for k, opt in enumerate(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                out[f"opt{k}/g{g}/p{i}/main"] = p.detach().cpu().clone()
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"opt{k}/g{g}/p{i}/{key}"] = value.detach().cpu().clone()
    return out


def rl_step(trainer, cfg, mbs) -> dict:
    from megatron_tail.train import (
        OpSettings,
        prepare_rl_micro_batches,
        recompute_logprobs,
        rl_loss_fn,
        train_step,
    )

    op = OpSettings(log_rho=cfg.log_rho)
    old = recompute_logprobs(trainer, mbs, op=op)
    for mb, o in zip(mbs, old, strict=True):  # the engine's log-probs: θ_old's plus the case's fixed noise
        engine = o.logprobs + mb.fields["engine_noise"]
        mb.fields["rollout_logprobs"] = torch.where(mb.loss_mask, engine, torch.zeros_like(engine))
    counts = prepare_rl_micro_batches(cfg, mbs, old, trainer.groups.dp)
    result = train_step(trainer, mbs, rl_loss_fn(cfg, counts), op=op)
    in_loss = [mb.loss_mask for mb in mbs]
    return {
        "loss": result.metrics["loss"],
        "grad_norm": result.grad_norm,
        "update_successful": result.update_successful,
        "vetoed_sequences": result.metrics.get("vetoed_sequences"),
        "is_zero_weight_tokens": result.metrics.get("is_zero_weight_tokens"),
        "safe_mass_min": min(float(o.safe_mass[m].min()) for o, m in zip(old, in_loss, strict=True)),
        "out_of_safe_set": sum(int((~o.in_safe_set[m]).sum()) for o, m in zip(old, in_loss, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="torch.save'd {'hf_dir', 'samples'}")
    parser.add_argument("out")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--save", default=None, help="after the two steps: save here, then one more step")
    parser.add_argument("--load", default=None, help="instead of the two steps: load this, then one step")
    args = parser.parse_args()
    single_rank_environment()
    from megatron_tail.utils.start_up import collector_paused

    with collector_paused():  # as `megatron-tail train` starts (train/run/cli.py)
        from megatron_tail.algorithms import AlgorithmConfig
        from megatron_tail.model import ModelSettings, load_hf_config
        from megatron_tail.train import (
            OptimizerSettings,
            build_trainer,
            init_distributed,
            init_parallel,
            load_checkpoint,
            pack_micro_batches,
            save_checkpoint,
        )

    case = torch.load(args.case, weights_only=False)
    init_distributed()  # NCCL where CUDA is visible, gloo otherwise
    groups = init_parallel(seed=1234)
    cfg = AlgorithmConfig(**CFG_KW)
    trainer = build_trainer(
        load_hf_config(case["hf_dir"]),
        hf_dir=None if args.load else case["hf_dir"],
        model_settings=ModelSettings(
            precision=args.precision, use_te=False, recompute="full", vocab_pad_multiple=128
        ),
        # Adam with ε = 1: the update ≈ lr·g, smooth in g, so bf16 and fp32 runs stay comparable (with a
        # small ε it is ≈ lr·sign(g), which turns rounding noise on near-zero gradients into full-size steps).
        optim=OptimizerSettings(lr=0.1, adam_eps=1.0, clip_grad=1e9, use_distributed_optimizer=True),
    )
    mbs = pack_micro_batches(case["samples"], max_tokens=MAX_TOKENS, dp_rank=groups.dp_rank, dp_size=1)
    assert len(mbs) > 1 and all(mb.packed for mb in mbs)
    out: dict = {"device": str(next(trainer.chunks[0].parameters()).device), "steps": []}
    if args.load:
        load_checkpoint(args.load, trainer)
        out["state_after_load"] = training_state(trainer)
    else:
        out["state_before"] = training_state(trainer)
        for _ in range(2):
            out["steps"].append(rl_step(trainer, cfg, mbs))
        out["hf_state"] = full_hf_state(trainer)
        out["state_after_steps"] = training_state(trainer)
        if args.save:
            save_checkpoint(args.save, trainer, {"step": 2})
            out["state_at_save"] = training_state(trainer)
    if args.save or args.load:
        out["third_step"] = rl_step(trainer, cfg, mbs)
        out["state_after_third_step"] = training_state(trainer)
    torch.save(out, args.out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
