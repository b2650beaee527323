"""`ModelSettings`: how to build the model (everything that is not the HF architecture). Imports no
megatron, so `megatron_tail.config` can build on it (the run config's `model` section extends it)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron_tail.ops.backend import BACKENDS, triton_unavailable
from megatron_tail.utils.errors import UserError

if TYPE_CHECKING:  # the methods import torch where they ask the host: loading a run's config does not
    import torch

Precision = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
"""megatron's selective-recompute modules for a dense model (TransformerConfig.recompute_modules)."""
MOE_ROUTER_DTYPES = (None, "fp32", "fp64")
"""`moe_router_dtype`'s values: megatron-core 0.16's `TransformerConfig.moe_router_dtype`, and None."""

DEFAULT_VOCAB_PAD_MULTIPLE = 1024
"""Pad the vocab to a multiple of 1024 = 128 × 8: the same padded size at every TP ≤ 8 (so checkpoints
reshard across TP sizes) and 128-aligned GEMMs."""


@dataclass(frozen=True)
class ModelSettings:
    """How to build the model (everything that is not the HF architecture). `None` = decide by the host."""

    precision: Precision | None = None
    """"bf16", "fp16" (megatron's dynamic loss scaling; `optimizer.initial_loss_scale` etc.) or "fp32"; both
    half precisions (megatron's `Float16Module`) keep fp32 main params in the optimizer. None: bf16 on CUDA,
    fp32 elsewhere (`precision_on`). fp16 trainer + fp16 engine is the simplest remedy for training–inference
    mismatch (its 10-bit mantissa rounds 8× finer than bf16's 7 bits)."""
    use_te: bool | None = None
    """Transformer Engine layer spec. Default: TE importable and CUDA present; else the local spec."""
    vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE
    """Padded vocab is a multiple of this; it must be divisible by TP (megatron shards rows evenly)."""
    use_cpu_initialization: bool | None = None
    """Initialise parameters on CPU (megatron's `use_cpu_initialization`). Default: no CUDA."""
    max_sequence_length: int | None = None
    """Longest sequence to run, at most the HF `max_position_embeddings` (the default): prompts that leave
    less than `rollout.max_new_tokens` below it are refused at load, an episode ends before a turn would
    pass it (`rollout/context_overflows`), and `megatron-tail plan` sizes activations for it
    (`config.run_inputs.context_limit`)."""
    fused_output_layer: bool = False
    """The last stage returns the final-norm hidden states instead of logits, and the trainer computes
    log-probs with the output layer fused into the DVP op, so the [tokens, V/TP] logits never exist
    (`megatron_tail.ops.vocab_parallel_linear_masked_logprobs`). Its backward adds the weight gradient into
    DDP's `main_grad` itself, with or without `gradient_accumulation_fusion`
    (`train.engine.forward.fused_layer_into_main_grad`)."""
    op_backend: str = "auto"
    """The DVP op's implementation (`megatron_tail.ops.backend`): "auto" (Triton kernels on CUDA, the
    chunked PyTorch code on CPU), "triton" or "torch" (the PyTorch code on the GPU too: an ablation, or a
    fallback). Both compute the same outputs and gradients up to float32 rounding."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism (with TP > 1): norms, residuals and dropout run on `s/tp` tokens per
    rank, so their activations are split over TP; packed micro-batches are padded to a multiple of TP."""
    recompute: Recompute = "none"
    """Activation recompute: "none"; "selective" (megatron's `recompute_granularity="selective"` over
    `recompute_modules`); "full" (every layer keeps only its input and is recomputed in backward:
    `recompute_granularity="full"`, `recompute_method="uniform"`, `recompute_num_layers`). Loss and
    gradients are unchanged; memory for time (full: about one more forward)."""
    recompute_num_layers: int | None = None
    """With recompute "full": layers per uniformly recomputed chunk (megatron's `recompute_num_layers`);
    None: 1 (each layer's input is kept, the least memory)."""
    recompute_modules: tuple[str, ...] = ("core_attn", "mlp")
    """With recompute "selective": which submodules to recompute, from megatron's "core_attn", "mlp",
    "layernorm". Default core attention and the MLP: with flash attention the MLP (SwiGLU's gate, up and
    product, 3·ffn values per token) is most of a layer's saved activations."""

    moe_aux_loss_coeff: float | None = None
    """Mixture-of-experts models: the load-balancing auxiliary loss coefficient (megatron's
    `moe_aux_loss_coeff`: `switch_load_balancing_loss_func` per MoE layer and micro-batch, summed over the
    layers, over the micro-batch's non-padding tokens). None: the number in the HF config's
    `router_aux_loss_coef` (0.001 for Qwen3-MoE) as megatron's coefficient, as Megatron-LM's own Qwen3-30B-A3B
    configuration sets it (`--moe-aux-loss-coeff 1e-3`, examples/post_training/modelopt/conf/qwen/
    Qwen3-30B-A3B.sh). That is not HF's loss at that coefficient: transformers' `load_balancing_loss_func`
    (models/qwen3_moe) pools every layer's routes into one loss without megatron's 1/k, about k / L as strong
    where the layers share an imbalance (1/6 for Qwen3-30B-A3B: k 8, L 48), and adds it only with the config's
    `output_router_logits`, which Qwen's MoE checkpoints ship false. 0 turns the loss off (the MoE demo's RL
    does). Ignored for dense models."""

    moe_router_dtype: str | None = None
    """Mixture-of-experts models: the dtype of the router's gating GEMM, its softmax and top-k, and the
    probabilities that weight the experts' outputs (megatron's `moe_router_dtype`: "fp32", "fp64"); None:
    the model's dtype (bf16 in training). megatron warns without it at 32 experts or more
    (`TransformerConfig.__post_init__`, "Consider enabling moe_router_dtype for better numerical
    stability"), and Megatron-LM's own Qwen3-30B-A3B configuration sets fp32
    (`examples/post_training/modelopt/conf/qwen/Qwen3-30B-A3B.sh`), as this repository's MoE examples do.
    SGLang 0.5.23 computes Qwen3-MoE's gate in the model's dtype and its softmax and top-k weights in fp32
    (`models/qwen3_moe.py`, `layers/moe/topk.py`): neither choice is its computation exactly. Default None,
    megatron's, so a run that leaves it unset trains as before."""

    gradient_accumulation_fusion: bool | None = None
    """megatron's gradient-accumulation fusion: each linear layer's backward adds its weight gradient
    straight into the parameter's float32 `main_grad` (DDP's buffer) with one GEMM, instead of returning a
    [out, in] gradient in the parameter's dtype that DDP's hook then adds to `main_grad`
    (`tensor_parallel/layers.py`, `LinearWithGradAccumulationAndAsyncCommunication.backward`: apex's
    `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`; the TE spec's linears: TE's
    `fuse_wgrad_accumulation`; the fused output layer does so with or without it). Each
    micro-batch's weight gradient is then summed in float32 from the start rather than rounded to bf16
    first, and megatron's linears skip the separate add (its read and write of `main_grad`). megatron's
    linears need apex's CUDA extension for it, TE spec or not (`ColumnParallelLinear.__init__` raises
    without it). Megatron-LM's `--gradient-accumulation-fusion` is on by default and refuses to build
    without the extension (its users pass `--no-gradient-accumulation-fusion`); here None turns it on only
    where it can run (CUDA and apex's `fused_weight_gradient_mlp_cuda` importable), and true without them is
    refused at load, naming what is missing."""

    def __post_init__(self) -> None:
        if self.gradient_accumulation_fusion not in (None, True, False):
            raise ValueError(
                f"gradient_accumulation_fusion must be true, false or null; got "
                f"{self.gradient_accumulation_fusion!r}"
            )
        if self.moe_router_dtype not in MOE_ROUTER_DTYPES:
            raise ValueError(
                f"moe_router_dtype must be one of {MOE_ROUTER_DTYPES}; got {self.moe_router_dtype!r}"
            )
        if self.moe_aux_loss_coeff is not None and (
            isinstance(self.moe_aux_loss_coeff, bool)
            or not isinstance(self.moe_aux_loss_coeff, int | float)
            or not self.moe_aux_loss_coeff >= 0
        ):
            raise ValueError(
                f"moe_aux_loss_coeff must be a number ≥ 0 or null; got {self.moe_aux_loss_coeff!r}"
            )
        if self.precision is not None and self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"precision must be 'bf16', 'fp16' or 'fp32'; got {self.precision!r}")
        if self.op_backend not in BACKENDS:
            raise ValueError(f"op_backend must be one of {BACKENDS}; got {self.op_backend!r}")
        if self.vocab_pad_multiple < 1:
            raise ValueError(f"vocab_pad_multiple must be ≥ 1; got {self.vocab_pad_multiple}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full'; got {self.recompute!r}")
        if self.recompute_num_layers is not None and (
            self.recompute != "full"
            or not isinstance(self.recompute_num_layers, int)
            or self.recompute_num_layers < 1
        ):
            raise ValueError(
                "recompute_num_layers must be an int ≥ 1, with recompute 'full'; "
                f"got {self.recompute_num_layers!r} with recompute {self.recompute!r}"
            )
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad or not self.recompute_modules:
            raise ValueError(
                f"recompute_modules must be a non-empty subset of {RECOMPUTE_MODULES}; "
                f"got {self.recompute_modules!r}"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be ≥ 1; got {self.max_sequence_length}")

    def check_host(self) -> None:
        """What these settings need of this machine, checked before megatron starts: UserError naming the
        run config's key (the trainer's tensors are on CUDA when it has a device, else on the CPU)."""
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.use_te and (not _have_transformer_engine() or device == "cpu"):
            lacks = "no CUDA device" if device == "cpu" else "no transformer_engine installed"
            raise UserError(
                f"model.use_te=true needs Transformer Engine on CUDA (a GPU extra), and this machine has "
                f"{lacks}; use model.use_te=false (megatron-core's local spec) or null (TE where it can run)"
            )
        if self.gradient_accumulation_fusion and (lacks := _wgrad_fusion_lacks(device)):
            raise UserError(
                "model.gradient_accumulation_fusion=true needs CUDA and apex's extension "
                "fused_weight_gradient_mlp_cuda (megatron's linear layers accumulate into main_grad "
                f"with it), and this machine has {lacks}; use false, or null (on where it can run)"
            )
        if self.op_backend == "triton" and (problem := triton_unavailable(device)):
            here = ", and this machine has no CUDA device" if device == "cpu" else ""
            raise UserError(
                f"model.op_backend=triton {problem}{here}; use op_backend auto (the Triton kernels on CUDA, "
                "the PyTorch code elsewhere) or torch"
            )

    def precision_on(self, cuda: bool) -> Precision:
        """`precision`, else the default of a host with (`cuda`) or without a CUDA device: bf16 or fp32. The
        one place the default is decided: the trainer asks for this host, the planner for a GPU's."""
        if self.precision is not None:
            return self.precision
        return "bf16" if cuda else "fp32"

    def resolved_precision(self) -> Precision:
        """`precision` on this host (`precision_on`)."""
        import torch

        return self.precision_on(torch.cuda.is_available())

    def resolved_dtype(self) -> torch.dtype:
        """The parameters' (and activations') dtype."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            self.resolved_precision()
        ]

    def resolved_use_te(self) -> bool:
        """`use_te` with the host default applied; raises if TE was asked for but is not installed."""
        have_te = _have_transformer_engine()
        if self.use_te is None:
            import torch

            return have_te and torch.cuda.is_available()
        if self.use_te and not have_te:
            raise ValueError(
                "use_te=True but transformer_engine is not installed; use_te=False picks the local spec"
            )
        return self.use_te

    def resolved_gradient_accumulation_fusion(self) -> bool:
        """`gradient_accumulation_fusion` with the host default applied (None: CUDA and apex's extension)."""
        if self.gradient_accumulation_fusion is not None:
            return self.gradient_accumulation_fusion
        import torch

        return not _wgrad_fusion_lacks("cuda" if torch.cuda.is_available() else "cpu")


def _wgrad_fusion_lacks(device: str) -> str:
    """What this host lacks for gradient-accumulation fusion ("" if nothing): a CUDA device, and apex's
    `fused_weight_gradient_mlp_cuda` importable. Imported, not only found, as megatron-core's
    `tensor_parallel/layers.py` decides at its import (`_grad_accum_fusion_available`): an extension built
    against another torch is found but does not load, and megatron's linears would then refuse to build."""
    lacks = [] if device == "cuda" else ["no CUDA device"]
    try:
        import torch  # noqa: F401 - a torch extension loads after torch

        importlib.import_module("fused_weight_gradient_mlp_cuda")
    except ImportError as e:
        found = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
        lacks.append(f"apex's extension installed but not loading ({e})" if found else "no apex installed")
    return " and ".join(lacks)


def _have_transformer_engine() -> bool:
    """Transformer Engine is installed (found, not imported: importing it needs CUDA's libraries)."""
    return importlib.util.find_spec("transformer_engine") is not None
