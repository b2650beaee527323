"""`model.gradient_accumulation_fusion`: megatron's linears add their weight gradients straight into DDP's
float32 `main_grad`, and one optimizer step gives the parameters it gives without the fusion: untied at
TP 2 with sequence parallelism, packed; tied embeddings at PP = 1 (megatron's `zero_out_wgrad`: the output
layer's dummy gradient must not hide the embedding's), with the output layer as megatron's linear and fused
into the DVP op. apex's CUDA extension is a recording stand-in (`apex_stand_in`); megatron's code around it
runs as on a GPU. At load, the setting is refused by name on a host without CUDA and the extension."""

from __future__ import annotations

import pytest

from megatron_tail.model import ModelSettings
from megatron_tail.utils.errors import UserError
from tests.harness import run_distributed
from tests.train.common import tiny_qwen3_dir
from tests.train.test_step_equivalence import _assert_same_step, _one_step_rank

HIDDEN = 64
"""`tests.model.hf_models.TINY`'s hidden size: the output layer's `main_grad` is [V/TP, HIDDEN]."""


def _fused_rank(rank, world_size, hf_dir, tp, micro_batch_size, packed, model):
    from tests.train import apex_stand_in

    apex_stand_in.install()
    state, result, probe = _one_step_rank(
        rank, world_size, hf_dir, tp, 1, micro_batch_size, packed, "linear", model, _probe
    )
    return state, result, list(apex_stand_in.CALLS), probe


def _probe(trainer, mbs, hf_dir):
    """Which weights the step's backward accumulated into `main_grad` itself (megatron's flag, reset by
    `zero_grad_buffer` at each step's start), and the frozen reference policy's log-probs: its weights
    have no DDP buffer, and the fused output layer must not ask for one."""
    from megatron_tail.train import OpSettings, recompute_logprobs
    from megatron_tail.train.engine.reference import build_reference

    flags = {
        name: p.grad_added_to_main_grad
        for name, p in trainer.chunks[-1].named_parameters()
        if name.endswith(("output_layer.weight", "word_embeddings.weight"))
    }
    reference = build_reference(trainer, hf_dir)
    outs = recompute_logprobs(trainer, mbs, op=OpSettings(log_rho=-13.0), chunks=reference.chunks)
    return flags, outs is not None and all(o.logprobs.isfinite().all() for o in outs)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, tie=True)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, tie=False)


def _reference(hf_dir):
    """Unfused, TP = PP = DP = 1, padded, 2 samples per micro-batch (4 micro-batches: the fusion sums)."""
    return run_distributed(_one_step_rank, 1, hf_dir, 1, 1, 2, False, "linear")[0]


@pytest.fixture(scope="module")
def tied_reference(tied_dir):
    return _reference(tied_dir)


@pytest.fixture(scope="module")
def untied_reference(untied_dir):
    return _reference(untied_dir)


def test_tp2_sp_packed_step_with_the_fusion_equals_the_step_without(untied_dir, untied_reference):
    model = {"gradient_accumulation_fusion": True, "sequence_parallel": True}
    results = run_distributed(_fused_rank, 2, untied_dir, 2, 1, True, model)
    state, result, calls, (_, reference_ran) = results[0]
    assert all(r[1] == result for r in results) and reference_ran
    _assert_same_step((state, result), untied_reference, untied_dir)
    # the four linears of each of the two layers (qkv, proj, fc1, fc2) and the output layer, per micro-batch
    micro_batches = calls.count((256 // 2, HIDDEN))
    assert micro_batches > 1 and len(calls) == 9 * micro_batches, calls


@pytest.mark.parametrize("fused_output_layer", [False, True], ids=["output-linear", "fused-output-layer"])
def test_tied_embeddings_keep_the_embeddings_gradient_under_the_fusion(
    tied_dir, tied_reference, fused_output_layer
):
    model = {"gradient_accumulation_fusion": True, "fused_output_layer": fused_output_layer}
    state, result, calls, (flags, reference_ran) = run_distributed(
        _fused_rank, 1, tied_dir, 1, 2, False, model
    )[0]
    _assert_same_step((state, result), tied_reference, tied_dir)
    # megatron's output linear went through the extension, or the fused op wrote main_grad itself
    assert ((256, HIDDEN) in calls) is not fused_output_layer, set(calls)
    assert list(flags.values()) == [True], flags  # the one shared weight, accumulated in place
    assert reference_ran  # the frozen reference (no main_grad) runs through the same output layer


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_fused_output_layer_adds_into_main_grad_without_the_fusion(
    tied, tied_dir, untied_dir, tied_reference, untied_reference
):
    """`forward.fused_layer_into_main_grad`: the fused layer accumulates into DDP's `main_grad` wherever the
    weight has one, with megatron's own linears returning their gradients (no apex): the step is the
    unfused one's, the embedding's own gradient kept when tied (`zero_out_wgrad`)."""
    hf_dir, reference = (tied_dir, tied_reference) if tied else (untied_dir, untied_reference)
    model = {"gradient_accumulation_fusion": False, "fused_output_layer": True}
    state, result, calls, (flags, reference_ran) = run_distributed(
        _fused_rank, 1, hf_dir, 1, 2, False, model
    )[0]
    _assert_same_step((state, result), reference, hf_dir)
    assert calls == []  # megatron's linears did not use apex's kernel
    output = [flag for name, flag in flags.items() if name.endswith("output_layer.weight")]
    embedding = [flag for name, flag in flags.items() if name.endswith("word_embeddings.weight")]
    # tied: the one shared weight (the embedding's), accumulated in place by the op
    assert (embedding, output) == (([True], []) if tied else ([False], [True])), flags
    assert reference_ran


def test_the_fusion_is_refused_by_name_where_it_cannot_run_and_off_by_default():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the refusal is for a host without it (apex decides the rest)")
    with pytest.raises(UserError, match=r"model\.gradient_accumulation_fusion=true needs CUDA and apex"):
        ModelSettings(gradient_accumulation_fusion=True).check_host()
    assert ModelSettings().resolved_gradient_accumulation_fusion() is False
    assert ModelSettings(gradient_accumulation_fusion=True).resolved_gradient_accumulation_fusion() is True
