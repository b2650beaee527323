"""One optimizer step gives the same parameters for TP=2 vs TP=1, PP=2 vs PP=1, DP=2 (split batch) vs DP=1,
packed (THD, by a token budget) vs padded micro-batches at each of those layouts, and with activation
recompute (selective, full) vs none."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.train.common import (
    PAD_MULTIPLE,
    full_hf_state,
    global_loss_tokens,
    init_rank,
    make_samples,
    masked_nll_loss,
    tiny_qwen3_dir,
)

N_SAMPLES = 8


def _one_step_rank(
    _rank, _world_size, hf_dir, tp, pp, micro_batch_size, packed, optimizer, model=None, probe=None
):
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OpSettings,
        OptimizerSettings,
        build_trainer,
        make_micro_batches,
        pack_micro_batches,
        split_for_data_parallel,
        train_step,
    )

    groups = init_rank(tp, pp)
    arch = load_hf_config(hf_dir)
    # "linear": Adam with ε = 1 makes the first update lr·g/(|g| + 1) ≈ lr·g, smooth in g (with a small ε
    # it is ≈ lr·sign(g), which turns fp32 noise on near-zero gradients into full-size differences).
    # clip_grad is huge: the norm is reported, nothing is clipped.
    eps = 1.0 if optimizer == "linear" else 1e-8
    optim = OptimizerSettings(lr=0.5 if optimizer == "linear" else 1e-3, adam_eps=eps, clip_grad=1e9)
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, **(model or {}))
    trainer = build_trainer(arch, hf_dir=hf_dir, model_settings=settings, optim=optim)
    multiple = tp if settings.sequence_parallel else 1
    if packed:
        # Packed micro-batches of ≤ 32 tokens hold 2–4 samples (of 6–14 tokens) each, balanced over DP.
        samples = make_samples(N_SAMPLES, seed=7)
        mbs = pack_micro_batches(
            samples, max_tokens=32, dp_rank=groups.dp_rank, dp_size=groups.dp_size, pad_to_multiple=multiple
        )
        assert len(mbs) * groups.dp_size < N_SAMPLES and all(mb.packed for mb in mbs)
    else:
        samples = split_for_data_parallel(make_samples(N_SAMPLES, seed=7), groups.dp_rank, groups.dp_size)
        mbs = make_micro_batches(samples, micro_batch_size=micro_batch_size, pad_to_multiple=multiple)
    loss_fn = masked_nll_loss(global_loss_tokens(mbs, groups.dp))
    result = train_step(trainer, mbs, loss_fn, op=OpSettings(log_rho=-13.0))
    if probe is not None:  # what a test asks of the trained model (picklable, returned third)
        return full_hf_state(trainer), result, probe(trainer, mbs, hf_dir)
    return full_hf_state(trainer), result


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, tie=False)


@pytest.fixture(scope="module")
def reference(hf_dir):
    """TP = PP = DP = 1, padded, 2 samples per micro-batch."""
    (state, result) = run_distributed(_one_step_rank, 1, hf_dir, 1, 1, 2, False, "linear")[0]
    return state, result


def _assert_same_step(got, reference, initial_dir):
    (state, result), (ref_state, ref_result) = got, reference
    assert result.update_successful and ref_result.update_successful
    assert result.metrics["loss_tokens"] == ref_result.metrics["loss_tokens"]
    assert result.metrics["loss"] == pytest.approx(ref_result.metrics["loss"], rel=1e-6)
    assert result.grad_norm == pytest.approx(ref_result.grad_norm, rel=1e-5)
    from megatron_tail.model.safetensors_io import SafetensorsReader

    with SafetensorsReader(initial_dir) as initial:
        moved = max((ref_state[n] - initial.get(n)).abs().max().item() for n in ref_state)
    assert moved > 1e-3  # the step really changed the parameters
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("tp", "pp", "world", "micro_batch_size"),
    [(2, 1, 2, 2), (1, 2, 2, 2), (1, 1, 2, 2)],
    ids=["tp2", "pp2", "dp2"],
)
def test_one_step_matches_single_rank(hf_dir, reference, tp, pp, world, micro_batch_size):
    results = run_distributed(_one_step_rank, world, hf_dir, tp, pp, micro_batch_size, False, "linear")
    assert all(r[1] == results[0][1] for r in results)  # every rank reports the same step result
    _assert_same_step(results[0], reference, hf_dir)


@pytest.mark.parametrize(
    ("tp", "pp", "world", "model"),
    [(1, 1, 1, None), (2, 1, 2, {"sequence_parallel": True}), (1, 2, 2, None), (1, 1, 2, None)],
    ids=["packed", "packed-tp2-sp", "packed-pp2", "packed-dp2"],
)
def test_packed_step_matches_padded(hf_dir, reference, tp, pp, world, model):
    results = run_distributed(_one_step_rank, world, hf_dir, tp, pp, 1, True, "linear", model)
    assert all(r[1] == results[0][1] for r in results)
    _assert_same_step(results[0], reference, hf_dir)


@pytest.mark.parametrize(
    "model",
    [{"recompute": "selective"}, {"recompute": "full"}, {"recompute": "full", "recompute_num_layers": 2}],
    ids=["selective", "full", "full-2-layers"],
)
def test_recompute_step_matches_no_recompute(hf_dir, reference, model):
    got = run_distributed(_one_step_rank, 1, hf_dir, 1, 1, 1, True, "linear", model)[0]
    _assert_same_step(got, reference, hf_dir)


def test_adam_step_tp2_pp2_dp1_runs(hf_dir):
    results = run_distributed(_one_step_rank, 4, hf_dir, 2, 2, 2, True, "adam")
    assert results[0][1].update_successful and results[0][1].grad_norm > 0


def _bf16_step_rank(rank, world_size, hf_dir):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        build_trainer,
        make_micro_batches,
        recompute_logprobs,
        train_step,
    )

    init_rank(2, 1)
    out = {}
    for bf16 in (False, True):
        settings = ModelSettings(precision="bf16" if bf16 else "fp32")
        trainer = build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=settings)
        mbs = make_micro_batches(make_samples(4, seed=1), micro_batch_size=2, seq_len=16)
        old = recompute_logprobs(trainer, mbs)
        result = train_step(trainer, mbs, masked_nll_loss(sum(mb.num_loss_tokens for mb in mbs)))
        out[bf16] = (result, old[0].logprobs.dtype, next(trainer.chunks[0].parameters()).dtype)
    return out


def test_bf16_step_runs_through_float16module(hf_dir):
    """The GPU precision path (Float16Module, bf16 params, fp32 main params) on CPU: close to fp32."""
    out = run_distributed(_bf16_step_rank, 2, hf_dir)[0]
    (fp32, lp32, p32), (bf16, lp16, p16) = out[False], out[True]
    assert (p32, p16, lp32, lp16) == (torch.float32, torch.bfloat16, torch.float32, torch.float32)
    assert bf16.update_successful
    assert bf16.metrics["loss"] == pytest.approx(fp32.metrics["loss"], rel=1e-2)
    assert bf16.grad_norm == pytest.approx(fp32.grad_norm, rel=5e-2)
