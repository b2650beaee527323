"""The op sharded over TP = 2 and 4 gloo ranks equals TP = 1, and equals minus megatron's cross entropy."""

import pytest
import torch
import torch.distributed as dist

from megatron_tail.ops import vocab_parallel_masked_logprobs
from tests.harness import init_megatron, run_distributed

OUTPUTS = ("logprobs", "entropy", "in_safe_set", "safe_mass", "logprobs_full", "top_logprob")


def full_problem(n, vocab_size, padded, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, padded, generator=gen) * 5.0
    logits[: n // 2] *= 3.0
    logits[:, vocab_size:] = 50.0  # megatron's padded columns may hold anything
    targets = torch.randint(0, vocab_size, (n,), generator=gen)
    targets[1] = logits[1, :vocab_size].argmin()
    grads = torch.randn(2, n, generator=gen)
    return logits.to(dtype), targets, grads


def sharded_run(rank, world, n, vocab_size, padded, dtype, log_rho, temperature):
    logits, targets, (g_l, g_h) = full_problem(n, vocab_size, padded, dtype)
    v_local = padded // world
    shard = logits[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        out = vocab_parallel_masked_logprobs(
            shard,
            targets,
            log_rho=log_rho,
            temperature=temperature,
            vocab_size=vocab_size,
            tp_group=dist.group.WORLD,
        )
        forward_calls = len(calls)
        ((out.logprobs * g_l).sum() + (out.entropy * g_h).sum()).backward()
    finally:
        dist.all_reduce = real_all_reduce
    return {name: getattr(out, name) for name in OUTPUTS} | {
        "grad": shard.grad,
        "forward_collectives": forward_calls,
        "backward_collectives": len(calls) - forward_calls,
    }


@pytest.mark.parametrize(
    ("world", "vocab_size", "padded", "dtype", "log_rho", "temperature"),
    [
        (2, 64, 64, torch.float32, -13.0, 1.0),
        (2, 61, 64, torch.bfloat16, -4.0, 0.7),  # uneven: the last shard is partly padding
        (4, 37, 40, torch.float32, -4.0, 1.3),
        (4, 25, 40, torch.float32, None, 1.0),  # rank 3 holds padding only
        (4, 64, 64, torch.bfloat16, -13.0, 1.0),
    ],
)
def test_tensor_parallel_equals_single_rank(world, vocab_size, padded, dtype, log_rho, temperature):
    n = 40
    results = run_distributed(sharded_run, world, n, vocab_size, padded, dtype, log_rho, temperature)
    single = sharded_run(0, 1, n, vocab_size, padded, dtype, log_rho, temperature)
    for rank, res in enumerate(results):
        assert res["forward_collectives"] == 2, "a MAX and one SUM"
        assert res["backward_collectives"] == 0
        for name in OUTPUTS:
            if name == "in_safe_set":
                assert torch.equal(res[name], single[name])
            else:
                torch.testing.assert_close(res[name], single[name], rtol=1e-5, atol=1e-5, msg=name)
        v_local = padded // world
        expected_grad = single["grad"][:, rank * v_local : (rank + 1) * v_local]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(res["grad"], expected_grad, rtol=tol, atol=tol)
    if log_rho is not None:
        assert not single["in_safe_set"][1]


def megatron_comparison(rank, world, dtype):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    init_megatron(tensor_parallel=world)
    logits, targets, (g, _) = full_problem(24, 96, 96, dtype)
    v_local = 96 // world
    shard = logits[:, rank * v_local : (rank + 1) * v_local]
    ours_in = shard.clone().requires_grad_()
    ours = vocab_parallel_masked_logprobs(
        ours_in, targets, log_rho=None, tp_group=parallel_state.get_tensor_model_parallel_group()
    )
    (ours.logprobs * g).sum().backward()
    theirs_in = shard.clone().requires_grad_()  # megatron overwrites fp32 inputs in place
    loss = vocab_parallel_cross_entropy(theirs_in.view(24, 1, -1), targets.view(24, 1)).view(24)
    (-loss * g).sum().backward()
    parallel_state.destroy_model_parallel()
    return ours.logprobs, -loss.detach().float(), ours_in.grad, theirs_in.grad


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_pruning_equals_minus_megatron_cross_entropy(world, dtype):
    for ours, theirs, ours_grad, theirs_grad in run_distributed(megatron_comparison, world, dtype):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours_grad.float(), theirs_grad.float(), rtol=tol, atol=tol)


def mismatched_shards(rank, _world):
    logits = torch.randn(4, 8 + rank)  # rank 1's shard is one column wider
    try:
        vocab_parallel_masked_logprobs(
            logits, torch.zeros(4, dtype=torch.long), vocab_size=16, tp_group=dist.group.WORLD
        )
    except ValueError as err:
        return str(err)
    return None


def mismatched_vocab_size(rank, _world):
    try:
        vocab_parallel_masked_logprobs(
            torch.randn(4, 8),
            torch.zeros(4, dtype=torch.long),
            vocab_size=15 + rank,
            tp_group=dist.group.WORLD,
        )
    except ValueError as err:
        return str(err)
    return None


def test_inconsistent_shards_across_ranks_are_refused_on_every_rank():
    messages = run_distributed(mismatched_shards, 2)
    assert all(m is not None and "V_local ranges from 8 to 9" in m for m in messages), messages
    messages = run_distributed(mismatched_vocab_size, 2)
    assert all(m is not None and "vocab_size differs" in m and "15" in m and "16" in m for m in messages), (
        messages
    )
