"""Where the TP = 1 op's time goes: each forward design's Triton kernels, and the backward's, timed alone on
the same logits with the inputs a call gives them, beside the whole op's times from `bench.op_designs`' rows.
What is left, op − kernels, is the op's work outside its `[N, V]` passes: the small torch ops on `[N]`
tensors (the target checks, θ, the finalize), their launches and the gaps between them.

Why it is printed: on the 2026-11-28 H200 run the op's forward took 5.0 ms and its two kernels, timed alone
the same day, 4.48 (1.39 + 3.09 ms at the tiles then): about 0.5 ms, a tenth of Liger's whole fwd + bwd,
sat outside them, and no run has attributed it. A large remainder here points at the `[N]` work, a small
one at the kernels.

Part of `python -m megatron_tail.bench.op --device cuda` (`op_report`), after the designs table. Off CUDA
the kernels run under Triton's interpreter: a check of the code path, not a measurement.
"""

from __future__ import annotations

import torch

from .op_designs import measured
from .op_peers import LOG_RHO, make_logits, measure


def _kernel_inputs(logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """What a TP = 1 call (DVP at `LOG_RHO`, T = 1, entropy, no |V_S| count) hands its kernels: the `[N]`
    max and θ, the target columns, and for the gradient the log normaliser and coefficients of a loss whose
    upstream gradients are 1 (the kernel's cost does not depend on their values)."""
    from megatron_tail.ops import triton_kernels as k
    from megatron_tail.ops.masked_logprobs import op_threshold
    from megatron_tail.ops.masked_logprobs_math import S_SAFE, target_columns
    from megatron_tail.ops.safe_vocab import rule_dtype

    compute = rule_dtype(logits.dtype)
    max_logit = k.row_max(logits, compute)
    threshold = op_threshold(max_logit, LOG_RHO, 1.0)
    local, owned = target_columns(targets, 0, logits.shape[1])
    sums = k.partial_sums(logits, max_logit, threshold, 1.0, local, owned, True, False)
    ones = torch.ones_like(max_logit)
    return {
        "compute": compute, "max_logit": max_logit, "threshold": threshold, "local": local, "owned": owned,
        "log_norm": torch.log(sums[:, S_SAFE]), "bias": -ones, "scale_h": -ones,
    }  # fmt: skip


def _forward_kernels(logits: torch.Tensor, inputs: dict, design):
    """The forward's `[N, V]` work under `design` alone: row max then partial sums, or `max_and_sums`."""
    from megatron_tail.ops import triton_kernels as k
    from megatron_tail.ops.masked_logprobs import threshold_offset

    i = inputs
    if design == k.TWO_KERNELS:

        def run():
            k.row_max(logits, i["compute"])
            k.partial_sums(logits, i["max_logit"], i["threshold"], 1.0, i["local"], i["owned"], True, False)

        return run
    offset, prune = threshold_offset(LOG_RHO, 1.0, i["compute"])

    def run_one():
        k.max_and_sums(
            logits, i["compute"], offset=offset, prune=prune, inv_temperature=1.0, local_target=i["local"],
            owned=i["owned"], with_entropy=True, with_count=False, launch=design,
        )  # fmt: skip

    return run_one


def _gradient_kernel(inputs: dict):
    """The backward's `[N, V]` pass alone, in place on a fresh clone of the logits (`run(fresh)`), writing the
    target's column as a call without a support has it do (`masked_logprobs.triton_backward`)."""
    from megatron_tail.ops import triton_kernels as k

    i = inputs
    targets = torch.where(i["owned"], i["local"], -1)

    def run(fresh):
        k.write_grad(
            fresh, fresh, max_logit=i["max_logit"], threshold=i["threshold"], log_norm=i["log_norm"],
            bias=i["bias"], scale_h=i["scale_h"], inv_temperature=1.0, targets=targets, target_start=0,
            target_add=i["bias"],
        )  # fmt: skip

    return run


def split_rows(designs: list[dict], tokens: int, width: int, *, device: str, repeats: int = 5) -> list[dict]:
    """One row per measured row of `designs` (`op_designs.design_rows` at this shape, same logits): `what`,
    the op's `forward_ms` and `ms` (fwd + bwd in place) from it, its forward kernels alone
    (`forward_kernels_ms`), the gradient kernel alone (`grad_kernel_ms`, the same for every design), and
    what is outside them (`forward_outside_ms` = forward_ms − forward kernels, `outside_ms` = ms − both)."""
    logits, targets = make_logits(tokens, width, device=device)
    inputs = _kernel_inputs(logits, targets)
    grad = measure(_gradient_kernel(inputs), repeats=repeats, prepare=logits.clone)["ms"]
    rows = []
    for design in measured(designs):
        forward = measure(_forward_kernels(logits, inputs, design["design"]), repeats=repeats)["ms"]
        rows.append(
            {
                "what": design["what"], "forward_ms": design["forward_ms"], "ms": design["ms"],
                "forward_kernels_ms": forward, "grad_kernel_ms": grad,
                "forward_outside_ms": design["forward_ms"] - forward,
                "outside_ms": design["ms"] - forward - grad,
            }
        )  # fmt: skip
    return rows


def format_split_rows(rows: list[dict], tokens: int, width: int, device_name: str) -> str:
    lines = [
        f"Where the TP = 1 op's time goes: {tokens} × {width} bf16 logits on {device_name}, DVP + entropy "
        "(op, Triton; its [N, V] kernels timed alone on the same logits)",
        "",
        "| design | forward ms | its kernels ms | outside them ms | fwd+bwd in place ms | kernels ms "
        "(+ gradient) | outside them ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kernels = r["forward_kernels_ms"] + r["grad_kernel_ms"]
        lines.append(
            f"| {r['what']} | {r['forward_ms']:.2f} | {r['forward_kernels_ms']:.2f} | "
            f"{r['forward_outside_ms']:.2f} ({100 * r['forward_outside_ms'] / r['forward_ms']:.0f}%) | "
            f"{r['ms']:.2f} | {kernels:.2f} | "
            f"{r['outside_ms']:.2f} ({100 * r['outside_ms'] / r['ms']:.0f}%) |"
        )
    return "\n".join(lines)
