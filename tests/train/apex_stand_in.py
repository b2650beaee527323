"""A recording stand-in for apex's `fused_weight_gradient_mlp_cuda` (a CUDA extension built from apex's
sources, not installable here), for the CPU half of `model.gradient_accumulation_fusion`.

megatron-core's linears call it exactly as on a GPU (`tensor_parallel/layers.py`,
`LinearWithGradAccumulationAndAsyncCommunication.backward`: `wgrad_gemm_accum_fp32(total_input, grad_output,
weight.main_grad)`, 2-D after `prepare_input_tensors_for_wgrad_compute`); this does what apex's kernels do
(`csrc/megatron/fused_weight_gradient_dense.cpp`: `d_weight += d_outputᵀ · input`, a GEMM accumulating into
`d_weight` in its own dtype), in torch. Everything megatron does around the call (the dummy gradient it
returns, `grad_added_to_main_grad`, DDP's hook, `zero_out_wgrad` for tied embeddings) runs for real."""

from __future__ import annotations

import sys
import types

import torch

CALLS: list[tuple[int, ...]] = []
"""The shape of each `main_grad` accumulated into, in call order."""


def _accumulate(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    CALLS.append(tuple(main_grad.shape))
    main_grad.add_(grad_output.t().to(main_grad.dtype) @ input.to(main_grad.dtype))


def install() -> None:
    """Make megatron's linears find the extension (in this process: call it in a forked rank)."""
    import megatron.core.tensor_parallel.layers as layers

    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.wgrad_gemm_accum_fp32 = _accumulate
    module.wgrad_gemm_accum_fp16 = _accumulate
    sys.modules[module.__name__] = module
    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True
