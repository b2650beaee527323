"""Each CPU patch is needed on the pinned megatron-core (the call fails without it, works with it)."""

import contextlib
import subprocess
import sys
import zipfile

import pytest
import torch

from megatron_tail.patches import (
    PatchVersionError,
    apply_cpu_patches,
    apply_cuda_shims,
    check_pinned,
    cpu_device_scope,
    cuda_shims_applied,
    remove_cuda_shims,
)
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU patches are no-ops where CUDA is present"
)


def tiny_gpt(tp: int = 1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
    )
    return config, GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)


def wrap_ddp(config, model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )


def outcome(fn):
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def ddp_with_and_without_shims(_rank, _world):
    remove_cuda_shims()
    config, model = tiny_gpt()
    without = outcome(lambda: wrap_ddp(config, model))
    apply_cpu_patches()
    with_shims = outcome(lambda: wrap_ddp(config, model))
    sync_with = outcome(torch.cuda.synchronize)
    remove_cuda_shims()
    sync_without = outcome(torch.cuda.synchronize)
    return without, with_shims, sync_without, sync_with


def test_cuda_shims_are_needed_for_megatron_ddp_and_synchronize():
    without, with_shims, sync_without, sync_with = run_distributed(ddp_with_and_without_shims, 1)[0]
    assert "Torch not compiled with CUDA enabled" in without
    assert with_shims == "ok"
    assert "Torch not compiled with CUDA enabled" in sync_without
    assert sync_with == "ok"


def optimizer_and_schedule(_rank, _world, scoped: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    apply_cpu_patches()
    config, model = tiny_gpt()
    ddp = wrap_ddp(config, model)
    scope = cpu_device_scope if scoped else contextlib.nullcontext
    results = {}
    opt_config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, bf16=False, fp16=False)
    with scope():
        results["optimizer"] = outcome(
            lambda: results.setdefault("opt", get_megatron_optimizer(opt_config, [ddp]))
        )
    ids = torch.randint(0, 32, (2, 8))
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)

    def forward_step(_iterator, m):
        out = m(ids, torch.arange(8).expand(2, 8), mask, labels=ids)
        return out, lambda o: (o.float().mean(), {})

    def run_schedule():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[ddp],
            num_microbatches=1,
            seq_length=8,
            micro_batch_size=2,
        )

    with scope():
        results["schedule"] = outcome(run_schedule)
    if "opt" in results:
        with scope():
            results["step"] = outcome(results["opt"].step)
    results.pop("opt", None)
    return results


def test_cpu_device_scope_is_needed_for_the_optimizer_and_the_schedule():
    without = run_distributed(optimizer_and_schedule, 1, False)[0]
    with_scope = run_distributed(optimizer_and_schedule, 1, True)[0]
    assert "torch.cuda.FloatTensor" in without["optimizer"] or "CUDA" in without["optimizer"], without
    assert "CUDA" in without["schedule"], without
    assert with_scope == {"optimizer": "ok", "schedule": "ok", "step": "ok"}, with_scope


def shims_idempotent(_rank, _world):
    remove_cuda_shims()
    original = torch.cuda.current_device
    assert apply_cuda_shims() and apply_cuda_shims()
    patched = torch.cuda.current_device
    first_again = torch.cuda.current_device is patched
    remove_cuda_shims()
    return first_again, torch.cuda.current_device is original, cuda_shims_applied(), str(patched())


def test_shims_are_idempotent_and_removable():
    first_again, restored, still_applied, device = run_distributed(shims_idempotent, 1)[0]
    assert first_again and restored and not still_applied
    assert device == "cpu"


def shims_noop_with_cuda(_rank, _world):
    remove_cuda_shims()
    torch.cuda.is_available = lambda: True
    return apply_cpu_patches(), cuda_shims_applied()


def test_patches_are_noops_where_cuda_is_present():
    assert run_distributed(shims_noop_with_cuda, 1)[0] == (False, False)


def test_version_pin_refuses_an_unverified_megatron_core():
    assert check_pinned().startswith("0.16.")
    with pytest.raises(
        PatchVersionError, match=r"megatron-core==0\.16\.\d+ is installed but .* verified on 0\.99\.x"
    ):
        check_pinned(prefix="0.99.")


def test_patches_ship_inside_the_built_wheel(tmp_path):
    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path),
    ]
    subprocess.run([*cmd, str(repo)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("megatron_tail-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("__init__", "cuda_shims", "cpu_device_scope", "pinning", "recompute_rng", "module_shims"):
        assert f"megatron_tail/patches/{module}.py" in names


def recompute_with_and_without_shims(_rank, _world):
    from megatron.core.tensor_parallel import checkpoint

    from megatron_tail.patches import apply_recompute_rng_shims, remove_recompute_rng_shims
    from tests.harness import init_megatron

    init_megatron()
    remove_recompute_rng_shims()
    x = torch.randn(4, 3, requires_grad=True)

    def grad_of(fn):
        x.grad = None
        fn(x).sum().backward()
        return x.grad.clone()

    def recomputed(t):
        return checkpoint(lambda u: torch.tanh(u) * u, False, t)

    without = outcome(lambda: grad_of(recomputed))
    applied = apply_recompute_rng_shims() and apply_recompute_rng_shims()
    got, expected = grad_of(recomputed), grad_of(lambda u: torch.tanh(u) * u)
    return without, applied, torch.equal(got, expected)


def test_recompute_rng_shims_are_needed_for_megatron_checkpoint():
    """megatron's activation recompute (`tensor_parallel.checkpoint`) saves the CUDA RNG state: on CPU it
    fails without the stand-ins, and with them gives the gradients of the plain function."""
    without, applied, same_grads = run_distributed(recompute_with_and_without_shims, 1)[0]
    assert "Torch not compiled with CUDA enabled" in without
    assert applied and same_grads
