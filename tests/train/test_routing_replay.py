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
    from megatron_tail.train.rl.routing import route_fields

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


def _trainer(hf_dir, tp=1, cp=1, sp=False, aux_loss=None):
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, ParallelConfig, build_trainer, init_parallel

    torch.set_num_threads(1)
    groups = init_parallel(ParallelConfig(tensor_parallel=tp, context_parallel=cp))
    settings = ModelSettings(
        vocab_pad_multiple=PAD_MULTIPLE, sequence_parallel=sp, moe_aux_loss_coeff=aux_loss
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


def _rl_step(rank, world, hf_dir, samples, tp, cp, sp, packed):  # noqa: ARG001
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

    # megatron's load-balancing loss counts every token slot of a micro-batch, padding included (the router
    # gets no padding mask), so its gradient depends on the layout: off here, the policy loss is compared
    groups, trainer = _trainer(hf_dir, tp=tp, cp=cp, sp=sp, aux_loss=0.0)
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


def test_route_field_names_agree():
    from megatron_tail.train.engine import routing as engine
    from megatron_tail.train.rl import routing as rl

    assert (rl.ROUTES_FIELD, rl.ROUTED_FIELD) == (engine.ROUTES_FIELD, engine.ROUTED_FIELD)
