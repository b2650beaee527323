"""`ops.matmul_accumulate.add_matmul_`, the fused output layer's in-place gradient accumulation: each path
(same dtype; a wider dest by row blocks, upcast on CPU or in the operands' dtype as on CUDA) against float64,
in place, over several blocks and a transposed operand (dlogitsᵀ is a view); the CUDA `out_dtype` overload's
probe falls back where torch refuses it."""

from __future__ import annotations

import pytest
import torch

import megatron_tail.ops.matmul_accumulate as acc


def _operands(dtype, m=40, n=12, k=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    dlogits = torch.randn(n, m, generator=g).to(dtype)  # a = dlogitsᵀ, a strided view, as in the op
    b = torch.randn(n, k, generator=g).to(dtype)
    dest = torch.randn(m, k, generator=g)
    return dest, dlogits.t(), b


def test_a_dest_in_the_operands_dtype_is_one_addmm_in_place():
    dest, a, b = _operands(torch.bfloat16)
    dest = dest.bfloat16()
    want = dest.double() + a.double() @ b.double()
    ptr = dest.data_ptr()
    assert acc.accumulation_path(dest, a) == "addmm"
    acc.add_matmul_(dest, a, b)
    assert dest.data_ptr() == ptr
    torch.testing.assert_close(dest.double(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))


@pytest.mark.parametrize("upcast", [True, False], ids=["cpu-upcast", "cuda-operand-dtype-product"])
def test_a_float32_dest_is_accumulated_in_row_blocks(monkeypatch, upcast):
    monkeypatch.setattr(acc, "BLOCK_ELEMENTS", 7 * 24)  # 7 rows per block: 6 blocks, the last short
    dest, a, b = _operands(torch.bfloat16)
    want = dest.double() + a.double() @ b.double()
    before = dest.clone()
    view = dest[3:]  # a row slice, as `grad_weight[c]` and `main_grad[:num_valid]` are
    acc.add_matmul_blocks_(view, a[3:], b, upcast=upcast)
    assert torch.equal(dest[:3], before[:3])
    if upcast:  # products of bf16 values are exact in float32: float32 summation error only
        torch.testing.assert_close(dest[3:].double(), want[3:], rtol=1e-6, atol=1e-5)
    else:  # the product rounded to bf16 once, then added in float32
        product = (a[3:] @ b).double()
        torch.testing.assert_close(dest[3:].double(), before[3:].double() + product, rtol=1e-6, atol=1e-6)


def test_on_cpu_a_wider_dest_takes_the_blocks_and_the_probe_is_cached(monkeypatch):
    dest, a, b = _operands(torch.bfloat16, seed=1)
    assert acc.accumulation_path(dest, a) == "blocks"  # the CPU path never asks for out_dtype
    want = dest.double() + a.double() @ b.double()
    acc.add_matmul_(dest, a, b)
    torch.testing.assert_close(dest.double(), want, rtol=1e-6, atol=1e-5)
    # a CPU build refuses the overload (NotImplementedError); an old torch lacks the keyword (TypeError)
    monkeypatch.setattr(acc, "_OUT_DTYPE_WORKS", {})
    assert not acc._out_dtype_addmm_works(torch.device("cpu"), torch.bfloat16, torch.float32)
    calls = []

    def refusing(*_args, **kwargs):
        calls.append(kwargs)
        raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(acc, "_OUT_DTYPE_WORKS", {})
    monkeypatch.setattr(torch, "addmm", refusing)
    for _ in range(2):
        assert not acc._out_dtype_addmm_works(torch.device("cpu"), torch.float16, torch.float32)
    assert len(calls) == 1 and calls[0]["out_dtype"] == torch.float32
