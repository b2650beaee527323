"""The fused output layer's backward holds nothing of the weight's size but the weight gradient (issue 51):
every tensor storage an aten op creates during backward is logged with its shape and dtype, on both backends
(the Triton one under Triton's interpreter), with and without megatron's gradient-accumulation fusion.

Before the fix the Triton backward held a float32 `[V, H]` accumulator, each token chunk's `[V, H]` product in
bf16 and its float32 copy, and a bf16 copy of the accumulator: four `[V, H]` temporaries besides the gradient,
peak extra 12 bytes per weight element; the PyTorch backend held the float32 accumulator, the product and its
copy whenever a block spans the whole vocabulary. After it: the gradient (or nothing, into `main_grad`), then
O(chunk) blocks and the `[N, H]` hidden gradient.

`bench.tensor_memory.LiveTensorBytes` reports the peak of live storage only; this check needs each
allocation's shape and dtype to name a `[V, H]` temporary, hence its own log (the same storage-weakref rule).
"""

from __future__ import annotations

import gc

import pytest
import torch
import triton
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import megatron_tail.ops.linear_masked_logprobs as fused_impl
import megatron_tail.ops.matmul_accumulate as matmul_accumulate
from megatron_tail.ops import vocab_parallel_linear_masked_logprobs
from tests.triton_interpreter import UNDER_INTERPRETER

N, H, V = 48, 64, 1024
CHUNK_ROWS = 8
"""Token rows per block on both backends (6 blocks): a block has 1/8 of the weight's elements, so a float32
block stays below half a bf16 gradient, the size from which an allocation counts as weight-sized."""


class AllocationLog(TorchDispatchMode):
    """While active: each new tensor storage an aten op returns, as (op, shape, dtype, bytes), and the peak of
    the bytes of those still referenced (frees are seen at the next op). An output sharing its storage with
    an input of the op (a view, an in-place or `out=` op) is not new, so storages that existed before (the
    inputs, `main_grad`) and views of them are never counted."""

    def __init__(self, collect_before=None) -> None:
        super().__init__()
        self.collect_before = collect_before
        """An op before which Python's garbage is collected: a kernel launch under Triton's interpreter holds
        its tensor arguments in a reference cycle (a compiled launch on CUDA does not), which would keep
        the previous block alive into the next block's GEMM."""
        self.allocations: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.paused = False
        """While set, new storages are not logged (`cuda_accumulation`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.collect_before:
            gc.collect()
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for key, (ref, _) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live and key not in inputs:
                    self._live[key] = (StorageWeakRef(storage), nbytes)
                    self.allocations.append((str(func), tuple(t.shape), t.dtype, nbytes))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self._live.values()))
        return out

    def at_least(self, nbytes: int) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
        return [a for a in self.allocations if a[3] >= nbytes]


def _backward_log(backend: str, fusion: bool, dtype: torch.dtype, log: AllocationLog | None = None):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(V, H, generator=g) / H**0.5).to(dtype))
    if fusion:
        weight.main_grad = torch.zeros(V, H, dtype=torch.float32)
    targets = torch.randint(0, V, (N,), generator=g)
    out = vocab_parallel_linear_masked_logprobs(
        hidden, weight, targets, log_rho=-13.0, gradient_accumulation_fusion=fusion, backend=backend
    )
    loss = out.logprobs.sum() + out.entropy.sum()
    log = AllocationLog() if log is None else log
    with log:
        loss.backward()
    return log, weight


@pytest.fixture
def blocks_of_chunk_rows(monkeypatch):
    """Both backends in token blocks of `CHUNK_ROWS` whole-vocabulary rows (the PyTorch backend's one-pass
    layout, whose block then spans the whole vocabulary: the case that held `[V, H]` float32 temporaries)."""
    monkeypatch.setitem(fused_impl.TRITON_CHUNK_ELEMENTS, "cpu", CHUNK_ROWS * V)
    monkeypatch.setitem(fused_impl.BLOCK_ELEMENTS, "cpu", CHUNK_ROWS * V)
    monkeypatch.setattr(fused_impl, "ONE_PASS_MIN_ROWS", CHUNK_ROWS)


def _check(log: AllocationLog, dtype: torch.dtype, fusion: bool) -> None:
    weight_elements = V * H
    block_bytes = CHUNK_ROWS * V * 4  # one block of logits in float32, the widest dtype a block is held in
    gradient = weight_elements * torch.finfo(dtype).bits // 8
    large = log.at_least(gradient // 2)
    if fusion:  # straight into main_grad; no `grad_added_to_main_grad`: no dummy gradient returned
        assert large == [], large
    else:
        assert [(shape, dt) for _, shape, dt, _ in large] == [((V, H), dtype)], large
    gradient = 0 if fusion else gradient
    hidden_grads = 2 * N * H * 4  # the [N, H] hidden gradient and its copy in the hidden states' dtype
    # the PyTorch backend's float32 temporaries of a block (the upcast, z, e^z, the safe indicator, the
    # dlogits' float32 copy) next to the bf16 block itself
    assert log.peak <= gradient + hidden_grads + 6 * block_bytes, (log.peak, gradient, block_bytes)


@pytest.mark.usefixtures("blocks_of_chunk_rows")
@pytest.mark.parametrize("fusion", [False, True], ids=["returned-grad", "main_grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_torch_backward_holds_no_weight_sized_temporary(dtype, fusion):
    log, _ = _backward_log("torch", fusion, dtype)
    _check(log, dtype, fusion)


@pytest.mark.usefixtures("blocks_of_chunk_rows")
@pytest.mark.parametrize("fusion", [False, True], ids=["returned-grad", "main_grad"])
@UNDER_INTERPRETER[0]
@UNDER_INTERPRETER[1]
def test_the_triton_backward_holds_no_weight_sized_temporary(fusion):
    log, _ = _backward_log("triton", fusion, torch.bfloat16)
    _check(log, torch.bfloat16, fusion)


def liger_chunk_bytes(tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The one `[chunk, V]` logits buffer of Liger-Kernel 0.8.5's fused linear cross entropy besides its
    weight and input gradients (`liger_kernel/ops/fused_linear_cross_entropy.py`, `chunk_mem_const` 1:
    `chunk = min(next_power_of_2(⌈N / ⌈V/H⌉⌉), N)`), what the H200 run of 2026-12-01 measured it holding
    (1,326 MiB at 8,192 × 4,096 @ 151,936 bf16: the bf16 weight gradient, 1,187, the input gradient, 64, and
    a 256-row chunk, 74)."""
    chunk = min(triton.next_power_of_2(-(-tokens // -(-vocab // hidden_size))), tokens)
    return chunk * vocab * torch.finfo(dtype).bits // 8


@UNDER_INTERPRETER[0]
@UNDER_INTERPRETER[1]
def test_the_triton_backward_holds_less_than_liger_besides_the_gradients(monkeypatch):
    """Issue 51: at its default blocks, the Triton backward's peak besides the weight gradient it returns and
    the `[N, H]` hidden gradient stays under Liger's one chunk of logits (here 4 rows: 8 KiB). Before, it held
    one token chunk of whole rows (here all 48: 96 KiB; on the H200, 1,766 rows, 512 MiB: 1.33× Liger's peak
    at 8,192 × 4,096 @ 151,936, 1.38× at 4,096 tokens). (Into `main_grad` it keeps the forward's chunks:
    `linear_masked_logprobs.BACKWARD_TOKEN_BLOCKS`.)

    On CUDA each accumulation is one cuBLAS call with nothing allocated (`matmul_accumulate`, the
    "addmm_out_dtype" path into a float32 destination); the CPU fallback upcasts its operands, so its
    allocations are left out of the log here, as the CUDA path has none."""
    log = AllocationLog(collect_before=torch.ops.aten.mm.default)
    fallback = matmul_accumulate.add_matmul_blocks_

    def cuda_accumulation(*args, **kwargs):
        log.paused = True
        try:
            return fallback(*args, **kwargs)
        finally:
            log.paused = False

    monkeypatch.setattr(matmul_accumulate, "add_matmul_blocks_", cuda_accumulation)
    _backward_log("triton", False, torch.bfloat16, log)
    gradients = N * H * 2 + V * H * 2
    working = log.peak - gradients
    assert working < liger_chunk_bytes(N, V, H, torch.bfloat16), working
    # what it is: a [rows, H] block of logits in bf16 and the float32 accumulator, and [N]-sized state
    # (any row-block value `bench.op` may print for the constant: a count, or a count over k·H-wide columns)
    count, k = fused_impl._row_blocks_and_width(fused_impl.BACKWARD_TOKEN_BLOCKS)
    rows = -(-N // count)
    block_and_accumulator = rows * k * H * 2 + rows * H * 4
    assert block_and_accumulator <= working <= 1.25 * block_and_accumulator, (working, block_and_accumulator)
