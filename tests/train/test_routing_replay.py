"""Routing replay (`algorithm.routing_replay`, `train.engine.routing`): a replayed forward uses exactly the
given experts (against a float64 HF reference whose routers take the routes as input), the routers' routing
maps equal the engine's routes on every (token, layer), packed / CP = 2 / TP = 2 with sequence parallelism
give the unpacked step, and the agreement metric counts what it says."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.train.engine.batch import Sample
from tests.harness import run_distributed
from tests.model.hf_moe import TINY_MOE, make_hf_moe
from tests.train.common import PAD_MULTIPLE

LAYERS, K, EXPERTS = TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts_per_tok"], TINY_MOE["num_experts"]
MOE_LAYERS = [i for i in range(LAYERS) if i not in TINY_MOE["mlp_only_layers"]]


def _routes(n: int, g: torch.Generator) -> torch.Tensor:
    """An engine's routes of n tokens: `[n − 1, layers, k]` int32, k distinct random experts per MoE layer,
    0 in the dense layer's column (as SGLang returns them)."""
    out = torch.zeros((n - 1, LAYERS, K), dtype=torch.int32)
    for layer in MOE_LAYERS:
        out[:, layer] = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(n - 1)]).int()
    return out


def _samples(seed: int, n: int = 6) -> list[Sample]:
    from megatron_tail.rollout.routes import route_fields

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(2, 7, (), generator=g)), int(torch.randint(2, 7, (), generator=g))
        ids = torch.randint(2, TINY_MOE["vocab_size"], (p + r,), generator=g).tolist()
        fields = {
            "rollout_logprobs": -1.0 - torch.rand(r, generator=g),
            "advantages": torch.full((r,), (-1.0) ** i * 0.5),
        }
        pos = route_fields(_routes(p + r, g), p + r, f"sample {i}")
        out.append(Sample(ids[:p], ids[p:], fields, position_fields=pos))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    make_hf_moe(path, norm_topk_prob=True)
    return str(path)


def _trainer(hf_dir, tp=1, cp=1, sp=False, aux_loss=None, **model):
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, init_parallel

    torch.set_num_threads(1)
    groups = init_parallel(ParallelSection(tensor_parallel=tp, context_parallel=cp))
    settings = ModelSettings(
        vocab_pad_multiple=PAD_MULTIPLE, sequence_parallel=sp, moe_aux_loss_coeff=aux_loss, **model
    )
    optim = OptimizerSettings(lr=0.5, adam_eps=1.0, clip_grad=1e9)
    return groups, build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=settings, optim=optim)


def _layout(samples, groups, *, packed, tp=1, cp=1, sp=False):
    from megatron_tail.train import make_micro_batches, pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel

    seq = 2 * cp if cp > 1 else 1
    multiple = seq * (tp if sp else 1)
    if not packed:
        return make_micro_batches(samples, micro_batch_size=2, pad_to_multiple=multiple)
    mbs = pack_micro_batches(samples, max_tokens=32, pad_to_multiple=multiple, sequence_multiple=seq)
    return [split_for_context_parallel(mb, groups.cp_rank, cp) for mb in mbs]


def _per_sample_logprobs(mbs, outs):
    got = {}
    for mb, out in zip(mbs, outs, strict=True):
        whole = mb.whole.to_samples(out.logprobs)
        for k, i in enumerate(mb.whole.sample_ids.tolist()):
            got[i] = whole[k][mb.whole.sample_valid[k]]
    return got


def _replayed_logprobs(rank, world, hf_dir, samples, packed, shift):  # noqa: ARG001
    from megatron_tail.train import recompute_logprobs
    from megatron_tail.train.engine.routing import ROUTES_FIELD, RoutingPass

    groups, trainer = _trainer(hf_dir)
    if shift:  # other experts than the ones given: the logits must move
        samples = [
            Sample(s.prompt, s.response, s.fields, position_fields={
                **s.position_fields, ROUTES_FIELD: (s.position_fields[ROUTES_FIELD] + 1) % EXPERTS
            })
            for s in samples
        ]  # fmt: skip
    mbs = _layout(samples, groups, packed=packed)
    outs = recompute_logprobs(trainer, mbs, routing=RoutingPass(trainer.chunks, "replay_field"))
    return _per_sample_logprobs(mbs, outs)


def _hf_reference(hf_dir, samples) -> dict[int, torch.Tensor]:
    """float64 HF Qwen3-MoE whose routers take the routes as input: each MoE layer's gate returns the given
    experts with weights softmax(logits) at them, renormalised (`norm_topk_prob`), as HF's router does."""
    from transformers import AutoModelForCausalLM

    from megatron_tail.train.engine.routing import ROUTES_FIELD

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()  # grouped_mm has no float64
    out = {}
    for i, s in enumerate(samples):
        routes = s.position_fields[ROUTES_FIELD].long()  # [n, layers, k]
        for layer_id, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue

            def forward(hidden, gate=gate, idx=routes[:, layer_id]):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                probs = torch.softmax(logits, dim=-1).gather(1, idx)
                return logits, probs / probs.sum(-1, keepdim=True), idx

            gate.forward = forward
        ids = torch.tensor([[*s.prompt, *s.response]])
        with torch.no_grad():
            logits = model(ids).logits[0]
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        out[i] = logp[len(s.prompt) - 1 :]
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replayed_forward_uses_exactly_the_given_experts(hf_dir, packed):
    samples = _samples(1)
    reference = _hf_reference(hf_dir, samples)
    got = run_distributed(_replayed_logprobs, 1, hf_dir, samples, packed, False)[0]
    shifted = run_distributed(_replayed_logprobs, 1, hf_dir, samples, packed, True)[0]
    for i, ref in reference.items():
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-5, atol=1e-5, msg=f"sample {i}")
    assert max((shifted[i].double() - reference[i]).abs().max().item() for i in reference) > 1e-2


def _routing_maps(rank, world, hf_dir, samples, tp, cp, sp):  # noqa: ARG001
    """The routing maps megatron's routers produced in a replayed pass, per micro-batch and MoE layer, and
    the pass's statistics; plus a free pass's own routes (RECORD) and its statistics."""
    from megatron.core.utils import unwrap_model

    from megatron_tail.train import recompute_logprobs
    from megatron_tail.train.engine.routing import RECORDED, ROUTED_FIELD, ROUTES_FIELD, RoutingPass

    groups, trainer = _trainer(hf_dir, tp=tp, cp=cp, sp=sp)
    mbs = _layout(samples, groups, packed=cp > 1 or tp > 1, tp=tp, cp=cp, sp=sp)
    model = unwrap_model(trainer.chunks[0])
    maps = []
    hooks = [
        layer.mlp.router.register_forward_hook(lambda _m, _i, o: maps.append(o[1].detach().clone()))
        for layer in model.decoder.layers
        if hasattr(layer.mlp, "router")
    ]
    replay = RoutingPass(trainer.chunks, "replay_field", observe=True)
    recompute_logprobs(trainer, mbs, routing=replay)
    for h in hooks:
        h.remove()
    record = RoutingPass(trainer.chunks, "record", observe=True)
    recompute_logprobs(trainer, mbs, routing=record)
    # the engine's routes and their validity in router order, per micro-batch, by an independent path:
    # the whole row's positions in sequence-major order, then this rank's share
    from megatron_tail.train.engine.routing import router_order

    expected = [
        (router_order(mb.fields[ROUTES_FIELD], sequence_parallel=sp), router_order(mb.fields[ROUTED_FIELD],
                                                                                   sequence_parallel=sp))
        for mb in mbs
    ]  # fmt: skip
    return {
        "maps": maps,
        "expected": expected,
        "recorded": [mb.extras[RECORDED][0] for mb in mbs],
        "replay": replay.stats.reduce(groups).scalars(),
        "record": record.stats.reduce(groups).scalars(),
    }


def test_r3_routers_route_every_token_as_the_engine_did(hf_dir):
    samples = _samples(2)
    got = run_distributed(_routing_maps, 1, hf_dir, samples, 1, 1, False)[0]
    n_moe = len(MOE_LAYERS)
    assert len(got["maps"]) == n_moe * len(got["expected"])
    checked = 0
    for m, (routes, valid) in enumerate(got["expected"]):
        for j, layer in enumerate(MOE_LAYERS):
            routing_map = got["maps"][m * n_moe + j]  # [tokens, E] bool, router order
            want = torch.zeros_like(routing_map).scatter(1, routes[:, layer].long(), True)
            assert torch.equal(routing_map[valid], want[valid]), (m, layer)
            checked += int(valid.sum())
    assert checked == n_moe * sum(len(s) - 1 for s in samples)  # every routed (token, layer)
    # the positions without an engine route (padding, each sample's last token) go to k distinct experts
    # each, consecutive ones to the next k: before, every one of them to expert 0
    unrouted = torch.cat([got["maps"][m * n_moe][~valid] for m, (_, valid) in enumerate(got["expected"])])
    assert len(unrouted) >= len(samples) and (unrouted.sum(-1) == K).all()
    load = unrouted.sum(0)
    assert float(load.max()) <= 2 * float(load.float().mean()) + 1, load.tolist()
    assert got["replay"]["moe/routing_agreement"] == got["record"]["moe/routing_agreement"]
    # agreement, independently: the free pass's own routes against the engine's, top-k as sets
    agree = total = 0
    for (routes, valid), own in zip(got["expected"], got["recorded"], strict=True):
        for j, layer in enumerate(MOE_LAYERS):
            same = (own[j].sort(-1).values == routes[:, layer].long().sort(-1).values).all(-1)
            agree, total = agree + int(same[valid].sum()), total + int(valid.sum())
    assert got["record"]["moe/routing_agreement"] == pytest.approx(agree / total, abs=1e-12)
    assert 0.0 < agree / total < 1.0  # random routes: some agree (1 in 6 pairs), most do not
    assert got["replay"]["moe/load_imbalance_cv"] > 0.0


def _rl_step(rank, world, hf_dir, samples, tp, cp, sp, packed, model=None):  # noqa: ARG001
    from megatron_tail.algorithms import AlgorithmConfig
    from megatron_tail.train import (
        OpSettings,
        prepare_rl_micro_batches,
        recompute_logprobs,
        rl_loss_fn,
        train_step,
    )
    from megatron_tail.train.engine.routing import RoutingPass
    from tests.train.common import full_hf_state

    # megatron's load-balancing loss is a loss per micro-batch (expert counts over its tokens), and the
    # layouts group the samples differently, so its gradient depends on the layout: off here, the policy
    # loss is compared (padding itself no longer counts: `test_moe_aux_loss_scale.py`)
    groups, trainer = _trainer(hf_dir, tp=tp, cp=cp, sp=sp, aux_loss=0.0, **(model or {}))
    mbs = _layout(samples, groups, packed=packed, tp=tp, cp=cp, sp=sp)
    cfg = AlgorithmConfig(log_rho=None, is_mode="none", veto_threshold=0.0, routing_replay="r3")
    op = OpSettings(log_rho=None)
    old = recompute_logprobs(trainer, mbs, op=op, routing=RoutingPass(trainer.chunks, "replay_field"))
    counts = prepare_rl_micro_batches(cfg, mbs, old, groups.dp, groups.cp)
    step = train_step(
        trainer, mbs, rl_loss_fn(cfg, counts), op=op, routing=RoutingPass(trainer.chunks, "replay_field")
    )
    return step, full_hf_state(trainer)


@pytest.mark.parametrize(
    ("world", "tp", "cp", "sp"),
    [(1, 1, 1, False), (2, 1, 2, False), (2, 2, 1, True)],
    ids=["packed", "cp2", "tp2-sp"],
)
def test_packed_cp_and_sequence_parallel_replay_give_the_unpacked_step(hf_dir, world, tp, cp, sp):
    samples = _samples(3, n=4)
    ref_step, ref_state = run_distributed(_rl_step, 1, hf_dir, samples, 1, 1, False, False)[0]
    step, state = run_distributed(_rl_step, world, hf_dir, samples, tp, cp, sp, True)[0]
    assert ref_step.metrics["loss"] != 0.0
    assert step.metrics["loss"] == pytest.approx(ref_step.metrics["loss"], rel=1e-5, abs=1e-7)
    assert step.grad_norm == pytest.approx(ref_step.grad_norm, rel=1e-5)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-5, msg=name)


def _interleaved_grads(rank, world, hf_dir, samples, recompute):  # noqa: ARG001
    """Both micro-batches' forwards, then both backwards (the order of a 1F1B pipeline schedule, which on
    CPU's one-stage MoE megatron never runs), replaying each one's routes; the gradients."""
    from megatron.core.utils import unwrap_model

    from megatron_tail.train import make_micro_batches
    from megatron_tail.train.engine.routing import RoutingPass

    model = {"recompute": "full", "recompute_num_layers": 1} if recompute else {}
    _, trainer = _trainer(hf_dir, aux_loss=0.0, **model)
    chunk = trainer.chunks[0]
    chunk.train()
    mbs = make_micro_batches(samples, micro_batch_size=2, seq_len=16)  # same shapes: a stale route would fit
    routing = RoutingPass(trainer.chunks, "replay_field")
    weights = torch.randn(16, 2, 256, generator=torch.Generator().manual_seed(0))
    with routing:
        outs = []
        for mb in mbs:
            routing.before(chunk, mb)
            out = chunk(mb.tokens, None, None)
            routing.after(chunk, mb, out)
            outs.append(out)
        for out in outs:
            (out.transpose(0, 1) * weights).sum().backward()
    params = unwrap_model(chunk).named_parameters()
    return {n: p.main_grad.clone() for n, p in params if getattr(p, "main_grad", None) is not None}


def test_recompute_in_backward_replays_each_micro_batchs_routes(hf_dir):
    """Full activation recompute re-runs every layer's forward inside backward; the routers must replay the
    routes of the micro-batch being recomputed (REPLAY_BACKWARD), not the last forward's: with both forwards
    before both backwards, the gradients equal those without recompute."""
    samples = _samples(4, n=4)
    ref = run_distributed(_interleaved_grads, 1, hf_dir, samples, False)[0]
    got = run_distributed(_interleaved_grads, 1, hf_dir, samples, True)[0]
    assert ref.keys() == got.keys() and any("router" in n for n in ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def _replay_list_lengths(rank, world, hf_dir, samples, grad, recompute):  # noqa: ARG001
    """Each micro-batch's forward (and with `grad` its backward, as megatron's schedule without pipelining
    runs them) replaying its routes; the length of every MoE layer's `replay_backward_list` after each
    micro-batch's forward; the gradients."""
    from megatron.core.utils import unwrap_model

    from megatron_tail.train import make_micro_batches
    from megatron_tail.train.engine.routing import RoutingPass

    model = {"recompute": "full", "recompute_num_layers": 1} if recompute else {}
    _, trainer = _trainer(hf_dir, aux_loss=0.0, **model)
    chunk = trainer.chunks[0]
    chunk.train()
    mbs = make_micro_batches(samples, micro_batch_size=1, seq_len=16)
    routing = RoutingPass(trainer.chunks, "replay_field")
    weights = torch.randn(16, 1, 256, generator=torch.Generator().manual_seed(0))
    lengths = []
    with routing:
        for mb in mbs:
            routing.before(chunk, mb)
            with torch.set_grad_enabled(grad):
                out = chunk(mb.tokens, None, None)
            routing.after(chunk, mb, out)
            lengths.append([len(r.replay_backward_list) for _, r in routing.layers[id(chunk)]])
            if grad:
                (out.transpose(0, 1) * weights).sum().backward()
    params = unwrap_model(chunk).named_parameters()
    return lengths, {n: p.main_grad.clone() for n, p in params if getattr(p, "main_grad", None) is not None}


@pytest.mark.parametrize(
    ("grad", "recompute", "held"),
    [(False, False, 0), (True, False, 1), (True, True, 1)],
    ids=["no-grad", "backward", "recomputed"],
)
def test_a_pass_holds_the_replay_entries_of_the_micro_batches_still_to_be_recomputed_only(
    hf_dir, grad, recompute, held
):
    """megatron's `RouterReplay` appends each micro-batch's routes to `replay_backward_list`, which only a
    recomputed forward pops. Before, a θ_old pass (no backward) and an update without recompute held every
    micro-batch's entry of every MoE layer to the pass's end (1, 2, 3, 4 here): ~3 GB per million tokens of
    a rank's mini-batch for Qwen3-30B-A3B. Now the current micro-batch's only, and the gradients with and
    without recompute still agree."""
    samples = _samples(6, n=4)
    lengths, grads = run_distributed(_replay_list_lengths, 1, hf_dir, samples, grad, recompute)[0]
    assert lengths == [[held] * len(MOE_LAYERS)] * 4
    if recompute:
        ref = run_distributed(_replay_list_lengths, 1, hf_dir, samples, True, False)[0][1]
        assert ref.keys() == grads.keys() and any("router" in n for n in ref)
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def _r2_maps(rank, world, hf_dir, samples):  # noqa: ARG001
    """R2: a RECORD pass, then the routers' weights change (as an update would), then a pass that replays the
    recorded routes and one that routes freely; the routing maps of each."""
    from megatron.core.utils import unwrap_model

    from megatron_tail.train import recompute_logprobs
    from megatron_tail.train.engine.routing import RECORDED, RoutingPass

    groups, trainer = _trainer(hf_dir)
    mbs = _layout(samples, groups, packed=False)
    recompute_logprobs(trainer, mbs, routing=RoutingPass(trainer.chunks, "record"))
    model = unwrap_model(trainer.chunks[0])
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight, generator=torch.Generator().manual_seed(0)) * 3)
    out = {}
    for action in ("replay_recorded", "free"):
        maps = []
        hooks = [
            r.register_forward_hook(lambda _m, _i, o, maps=maps: maps.append(o[1].clone())) for r in routers
        ]
        recompute_logprobs(trainer, mbs, routing=RoutingPass(trainer.chunks, action))
        for h in hooks:
            h.remove()
        out[action] = maps
    recorded = [t for mb in mbs for t in mb.extras[RECORDED][0]]
    return out, recorded


def test_r2_update_passes_replay_the_routes_theta_old_chose(hf_dir):
    out, recorded = run_distributed(_r2_maps, 1, hf_dir, _samples(5))[0]
    assert len(recorded) == len(out["replay_recorded"]) == len(MOE_LAYERS) * 3  # 3 micro-batches
    differ = 0
    for rec, replayed, free in zip(recorded, out["replay_recorded"], out["free"], strict=True):
        assert torch.equal(replayed, torch.zeros_like(replayed).scatter(1, rec, True))
        differ += int((free != replayed).any(-1).sum())
    assert differ > 0  # the moved routers alone would route otherwise


def test_routes_survive_the_rollout_buffers_checkpoint(tmp_path):
    """Engine routes → RolloutBatch (compact) → the manager's checkpointed group (torch.save, weights_only
    load) → samples: each position keeps its route; select/concat move them with their samples."""
    import numpy as np

    from megatron_tail.config import config_from_dict
    from megatron_tail.rollout.batch import RolloutBatch, concat_batches, select_samples
    from megatron_tail.rollout.columns import LOGPROBS, ROUTES, VERSIONS
    from megatron_tail.rollout.manager import GroupResult
    from megatron_tail.rollout.routes import ROUTED_FIELD, ROUTES_FIELD, compact_routes
    from megatron_tail.train.rl.samples import build_samples

    g = torch.Generator().manual_seed(0)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    engine = [_routes(len(p) + len(r), g).numpy() for p, r in zip(prompts, responses, strict=True)]
    batch = RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=[1.0, 0.0],
        correct=[True, False],
        truncated=[False, False],
        weight_versions=["0", "0"],
        columns={
            LOGPROBS: [[-1.0] * len(r) for r in responses],
            VERSIONS: [[0] * len(r) for r in responses],
            ROUTES: [compact_routes(r) for r in engine],
        },
    )
    assert batch.column(ROUTES)[0].dtype == torch.uint8
    torch.save(GroupResult(3, batch, 0).to_state(), tmp_path / "group.pt")
    resumed = GroupResult.from_state(torch.load(tmp_path / "group.pt", weights_only=True)).batch
    both = concat_batches([select_samples(resumed, [1]), select_samples(resumed, [0])])
    cfg = config_from_dict({"algorithm": {"group_size": 2, "routing_replay": "r3"}})
    samples = build_samples(cfg, both).samples
    for sample, want in zip(samples, [engine[1], engine[0]], strict=True):
        routes = sample.position_fields[ROUTES_FIELD]
        assert np.array_equal(routes[:-1].numpy(), want) and not routes[-1].any()
        assert sample.position_fields[ROUTED_FIELD].tolist() == [True] * len(want) + [False]


def test_refusals_are_one_line(tmp_path):
    from megatron_tail.config import config_from_dict
    from megatron_tail.model import load_hf_config
    from megatron_tail.model.moe_arch import check_routing_replay
    from megatron_tail.rollout.batch import RolloutBatch
    from megatron_tail.rollout.columns import LOGPROBS
    from megatron_tail.rollout.routes import route_fields
    from megatron_tail.train.rl.samples import build_samples
    from megatron_tail.utils.errors import UserError
    from tests.model.hf_models import make_hf_model

    make_hf_model("qwen3", tmp_path)
    dense = load_hf_config(tmp_path)
    for mode in ("r2", "r3"):
        with pytest.raises(
            UserError, match=f"algorithm.routing_replay={mode} needs a mixture-of-experts"
        ) as e:
            check_routing_replay(mode, dense.moe, dense.architecture)
        assert "\n" not in str(e.value)
    check_routing_replay(config_from_dict({}).algorithm.routing_replay, dense.moe, dense.architecture)
    cfg = config_from_dict({"algorithm": {"group_size": 2, "routing_replay": "r3"}})
    batch = RolloutBatch(
        prompt_ids=[[1, 2]] * 2, response_ids=[[3]] * 2, rewards=[1.0, 0.0], correct=[True, False],
        truncated=[False] * 2, weight_versions=["0"] * 2,
        columns={LOGPROBS: [[-1.0]] * 2},
    )  # fmt: skip
    with pytest.raises(UserError, match="--enable-return-routed-experts") as e:
        build_samples(cfg, batch)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"sample 0: routed_experts has shape \(3, 3, 2\), expected \(2, "):
        route_fields(torch.zeros(3, 3, 2), 3, "sample 0")


def test_an_engine_without_routes_fails_the_step_with_one_line():
    """The client's MissingRoutesError (a server started without the flag) leaves the engines' `run` as one
    UserError line naming the flag, not an engine failure or a traceback."""
    import asyncio
    import types

    from megatron_tail.config import config_from_dict
    from megatron_tail.rollout.protocol import MissingRoutesError
    from megatron_tail.rollout.service.engines import Engines
    from megatron_tail.utils.errors import UserError

    async def generate():
        raise MissingRoutesError(
            "http://x/generate sample 0: no meta_info.routed_experts (--enable-return-routed-experts?)"
        )

    engines = object.__new__(Engines)
    engines.settings, engines.engine, engines._thread = config_from_dict({}).rollout, None, None
    engines.loop, engines.note = asyncio.new_event_loop(), print
    engines.__dict__["_watching"] = types.MethodType(lambda _self, coro, *_: coro, engines)
    try:
        with pytest.raises(UserError, match="--enable-return-routed-experts") as e:
            engines.run(generate(), "the batch of step 1")
    finally:
        engines.loop.close()
    assert "\n" not in str(e.value) and e.value.__cause__ is None


def test_a_pipeline_stage_of_dense_layers_only_joins_the_pass_of_a_replaying_model():
    """`RoutingPass.active` is the model's (its config), not the stage's: before, a stage holding only dense
    layers (a model with `mlp_only_layers` at PP > 1) ran no pass, while the stages with MoE layers reduced
    the pass's statistics over the pipeline group, waiting for it forever."""
    from types import SimpleNamespace

    from megatron_tail.train.engine.routing import RoutingPass

    def stage(replaying: bool):  # what megatron's unwrap_model returns as it is, no layer of it MoE
        config = SimpleNamespace(
            sequence_parallel=False, moe_layer_freq=[0, 0, 1, 1], num_moe_experts=8,
            moe_enable_routing_replay=replaying,
        )  # fmt: skip
        return SimpleNamespace(config=config, decoder=SimpleNamespace(layers=[]))

    for replaying in (True, False):
        chunk = stage(replaying)
        routing = RoutingPass([chunk], "replay_field", observe=replaying)
        assert routing.active is replaying and routing.layers[id(chunk)] == []
        if replaying:
            assert routing.stats.per_expert.shape == (2, 8)  # zeros of the model's two MoE layers
