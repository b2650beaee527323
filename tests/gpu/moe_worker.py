"""One trainer process of the MoE routing-replay check (`python -m tests.gpu.moe_worker CASE OUT --precision
bf16|fp32`): the tiny Qwen3-MoE of `moe_case` on the local spec with routing replay r3 and megatron's
load-balancing loss on, on whatever device the process sees (CUDA with NCCL and megatron's "alltoall" token
dispatcher at EP = 1, or the CPU with gloo, the CPU patches and "allgather" when `CUDA_VISIBLE_DEVICES=""`;
`model.moe.moe_dispatcher` picks it by the device, so the worker asserts it from the built model's config).

Two RL steps as the loop takes them (`train.run.loop._train_on`): `build_samples` → `layout_micro_batches`
→ `score_old_policy` (θ_old, r3 replays the engine's routes, adds `moe/routing_agreement`) →
`update_policy` (r3 again, adds `moe/aux_loss`), on the same `RolloutBatch` each step. Forward hooks on every
router keep the routing maps of each pass, so the worker can count the (position, MoE layer) pairs where a
replayed router used other experts than the engine's routes (full recompute re-runs each layer's forward
inside backward: those replays are counted too). Then one more step with a zero RL loss and free routing:
the last router's input, routing map, weight and `main_grad` go to OUT for the host's float64 check of the
aux loss's scale (`test_moe_cuda.check_aux_scale`).

Writes OUT (`torch.save`): per-step metrics, θ_old log-probs and replay counts,
`trainer_worker.training_state` before and after the two steps (fp32 main parameters included), the
aux-check tensors and the dispatcher.
"""

from __future__ import annotations

import argparse

import torch

from tests.gpu.trainer_worker import single_rank_environment

AUX_COEFF = 0.01
"""megatron's `moe_aux_loss_coeff` here (Qwen3-MoE's config says 0.001): large enough that the aux loss's
gradient is a visible part of the update the two runs compare."""
LR = 1e-4
"""Adam with ε = 1 moves each entry by lr·g/(|g| + 1), at most lr; the tiny model's gradient norm is ≈ 13.
At 1e-3 the second step's θ_old drifted far enough from the engine that a MIS weight reached 1.99 (at
MIS's bound of 2) and 3% of the tokens were rejected, decisions that rounding could flip; at 1e-4 the
largest weight stays ≈ 1.3 (mostly the engine's moved routers, `moe_case.ROUTER_NOISE`)."""
MAX_TOKENS = 64
"""Token budget of a packed micro-batch: 16 samples of 12–15 tokens make four THD rows."""


def run_config(hf_dir: str, precision: str):
    """The `RunConfig` of both runs (only the precision differs). Adam with ε = 1, as the dense CUDA check
    (`trainer_worker`): the update ≈ lr·g, smooth in g, so bf16 and fp32 stay comparable."""
    from megatron_tail.config import config_from_dict
    from tests.gpu.moe_case import GROUP, LOG_RHO, MAX_NEW_TOKENS

    return config_from_dict(
        {
            "model": {
                "hf_path": hf_dir, "precision": precision, "use_te": False, "recompute": "full",
                "vocab_pad_multiple": 128, "moe_aux_loss_coeff": AUX_COEFF,
            },
            "algorithm": {"group_size": GROUP, "log_rho": LOG_RHO, "routing_replay": "r3"},
            "optimizer": {"lr": LR, "adam_eps": 1.0, "clip_grad": 1e9, "use_distributed_optimizer": True},
            "train": {"max_tokens_per_micro_batch": MAX_TOKENS},
            "rollout": {"max_new_tokens": MAX_NEW_TOKENS},
            "data": {"reward_max_abs": 1.0},
        }
    )  # fmt: skip


class RouterMaps:
    """Forward hooks on every router of `model` (megatron's `TopKRouter.forward` returns `(probs,
    routing_map)`, `routing_map` `[tokens, E]` bool in router token order): the maps of each call, per
    global decoder-layer id, and the last router's inputs `[tokens, h]`."""

    def __init__(self, model):
        self.maps: dict[int, list[torch.Tensor]] = {}
        self.last_inputs: list[torch.Tensor] = []
        routers = [
            (layer.layer_number - 1, layer.mlp.router)
            for layer in model.decoder.layers
            if hasattr(layer.mlp, "router")
        ]
        for layer_id, router in routers:
            self.maps[layer_id] = []
            router.register_forward_hook(
                lambda _m, _i, out, k=layer_id: self.maps[k].append(out[1].detach().cpu())
            )
        self.last_router = routers[-1][1]
        self.last_router.register_forward_pre_hook(
            lambda _m, args: self.last_inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]).cpu())
        )

    def clear(self) -> None:
        for maps in self.maps.values():
            maps.clear()
        self.last_inputs.clear()

    def replay_misses(self, mbs) -> dict[str, int]:
        """Against the engine's routes of `mbs` (the micro-batches of the pass, in order): routed (position,
        MoE layer) pairs of every router call, and those whose routing map is not the engine's top-k set.
        A layer's calls are its forwards in micro-batch order, each followed by its recompute under full
        recompute (megatron's `forward_backward_no_pipelining`: backward right after each forward)."""
        from megatron_tail.rollout.routes import ROUTED_FIELD, ROUTES_FIELD
        from megatron_tail.train.engine.routing import router_order

        pairs = misses = 0
        for layer_id, maps in self.maps.items():
            per_mb, rest = divmod(len(maps), len(mbs))
            assert rest == 0 and per_mb >= 1, (layer_id, len(maps), len(mbs))
            for j, routing_map in enumerate(maps):
                mb = mbs[j // per_mb]
                routes = router_order(mb.fields[ROUTES_FIELD], sequence_parallel=False)[:, layer_id].long()
                valid = router_order(mb.fields[ROUTED_FIELD], sequence_parallel=False).bool()
                want = torch.zeros_like(routing_map).scatter(1, routes, True)
                pairs += int(valid.sum())
                misses += int((routing_map != want).any(-1)[valid].sum())
        return {"pairs": pairs, "misses": misses}


def rl_step(trainer, cfg, batch, maps: RouterMaps) -> dict:
    """One RL step as `train.run.loop` takes it (no reference model, no weight sync): its metrics, the θ_old
    log-probs per sample, and the replay counts of the θ_old and update passes."""
    from megatron_tail.train.engine.lr_schedule import advance
    from megatron_tail.train.rl.old_policy import op_settings, score_old_policy
    from megatron_tail.train.rl.samples import build_samples, layout_micro_batches
    from megatron_tail.train.rl.update import update_policy
    from megatron_tail.train.run.rollout_plan import token_columns

    advance(trainer.scheduler)
    built = build_samples(cfg, batch, token_columns(cfg))
    layout = layout_micro_batches(cfg, built.samples, trainer.groups)
    assert len(layout.all) > 1 and all(mb.packed for mb in layout.all)
    maps.clear()
    old = score_old_policy(trainer, cfg, layout)
    old_replay = maps.replay_misses(layout.all)
    theta_old = {}  # sample index → its response tokens' θ_old log-probs, float64 [len(response)]
    for mb, out in zip(layout.all, old.outputs, strict=True):
        whole = mb.whole
        rows = whole.to_samples(out.logprobs)
        for k, i in enumerate(whole.sample_ids.tolist()):
            theta_old[i] = rows[k][whole.sample_valid[k]].double().cpu()
    maps.clear()
    update = update_policy(trainer, cfg.algorithm, layout, old, op=op_settings(cfg))
    update_replay = maps.replay_misses(layout.all)
    return {
        "metrics": {**update.metrics, **old.diagnostics},
        "theta_old": theta_old,
        "old_replay": old_replay,
        "update_replay": update_replay,
        "micro_batches": len(layout.all),
    }


def aux_step(trainer, cfg, batch, maps: RouterMaps) -> dict:
    """One training step with the RL loss zeroed and the routers free: the last router's weight before it
    (`[E, h]`, float64), per micro-batch its inputs (`[T_m, h]`, float64 of the model dtype's values) and
    routing maps (`[T_m, E]` bool, this pass's forwards, not their recomputes), and its `main_grad` (fp32)."""
    from megatron_tail.train import train_step
    from megatron_tail.train.rl.samples import build_samples, layout_micro_batches
    from megatron_tail.train.run.rollout_plan import token_columns

    layout = layout_micro_batches(cfg, build_samples(cfg, batch, token_columns(cfg)).samples, trainer.groups)
    router = maps.last_router
    weight = router.weight.detach().double().cpu().clone()
    maps.clear()

    def zero_loss(out, mb):  # noqa: ARG001 - the RL loss contributes no gradient
        return (out.logprobs * 0.0).sum(), {}

    result = train_step(trainer, layout.all, zero_loss)
    assert result.update_successful
    per_mb = len(maps.last_inputs) // len(layout.all)
    last_layer = max(maps.maps)
    return {
        "weight": weight,
        "inputs": [x.double() for x in maps.last_inputs[::per_mb]],
        "routing_maps": maps.maps[last_layer][::per_mb],
        "main_grad": router.weight.main_grad.detach().cpu().clone(),
        "coeff": AUX_COEFF,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="torch.save'd moe_case.build_moe_case")
    parser.add_argument("out")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    single_rank_environment()
    from megatron_tail.utils.start_up import collector_paused

    with collector_paused():  # as `megatron-tail train` starts (train/run/cli.py)
        from megatron.core.utils import unwrap_model

        from megatron_tail.model import load_hf_config
        from megatron_tail.train import build_trainer, init_distributed, init_parallel
        from tests.gpu.trainer_worker import training_state

    case = torch.load(args.case, weights_only=False)
    cfg = run_config(case["hf_dir"], args.precision)
    init_distributed()  # NCCL where CUDA is visible, gloo otherwise
    init_parallel(seed=cfg.seed)
    trainer = build_trainer(
        load_hf_config(case["hf_dir"]),
        hf_dir=case["hf_dir"],
        model_settings=cfg.model,
        optim=cfg.optimizer,
        run_steps=2,
    )
    config = trainer.config
    device = str(next(trainer.chunks[0].parameters()).device)
    dispatcher = "alltoall" if device.startswith("cuda") else "allgather"
    assert config.moe_token_dispatcher_type == dispatcher, config.moe_token_dispatcher_type
    assert config.expert_model_parallel_size == 1 and config.moe_enable_routing_replay
    maps = RouterMaps(unwrap_model(trainer.chunks[0]))
    out: dict = {
        "device": device,
        "dispatcher": config.moe_token_dispatcher_type,
        "params_dtype": str(config.params_dtype),
        "state_before": training_state(trainer),
    }
    out["steps"] = [rl_step(trainer, cfg, case["batch"], maps) for _ in range(2)]
    out["state_after_steps"] = training_state(trainer)
    out["aux"] = aux_step(trainer, cfg, case["batch"], maps)
    torch.save(out, args.out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
