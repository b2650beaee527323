"""The local engine's FP8 mode (`rollout.quantization: fp8`, SGLang's `--quantization fp8` scheme on CPU):
the e4m3 round trip is within e4m3's error bound against float64; the engine's log-probs equal an
independent float64 implementation of the scheme written here (not the production quantizer); weight
updates re-quantize; DVP's safe set is still the op's rule on the engine's own (FP8) logits."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.fp8 import Fp8Linear, dequantize, quantize_rows
from megatron_tail.rollout.local_engine.weights import read_safetensors_dir
from tests.rollout.test_local_engine import item

E4M3_MAX = 448.0
MANTISSA_BITS = 3
MIN_NORMAL_EXP = -6  # e4m3fn: smallest normal 2^-6, subnormal spacing 2^-9


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 → the nearest e4m3fn value (round half to even, saturating at ±448), written from the format's
    definition: spacing 2^(e − 3) for |v| in [2^e, 2^(e+1)), e ≥ −6; 2^−9 below 2^−6."""
    mag = v.abs()
    exponent = torch.floor(torch.log2(mag.clamp(min=2.0**MIN_NORMAL_EXP)))
    step = torch.pow(2.0, exponent - MANTISSA_BITS)
    return (torch.round(v / step) * step).clamp(-E4M3_MAX, E4M3_MAX)


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 `[..., K]` → its per-row e4m3 quantize–dequantize, scale = max|row| / 448."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX
    return e4m3_round(x / scale) * scale


def test_quantize_dequantize_error_is_within_e4m3s_bound():
    g = torch.Generator().manual_seed(0)
    # rows spanning 12 decades, plus a row of zeros and one with a single huge outlier
    x64 = (
        torch.randn(64, 256, generator=g, dtype=torch.float64)
        * torch.logspace(-6, 6, 64, dtype=torch.float64)[:, None]
    )
    x64[5] = 0.0
    x64[9, 17] = 1e5
    x = x64.float()
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = dequantize(q, scale).double()
    amax = x.double().abs().amax(dim=-1, keepdim=True)
    torch.testing.assert_close(
        scale.double(), (amax / E4M3_MAX).clamp(min=1e-10 / E4M3_MAX), rtol=2e-7, atol=0
    )
    # relative half-spacing of a 3-bit mantissa for normals; half the subnormal spacing (scaled) below them;
    # plus the fp32 rounding of the input and of x·(1/scale)
    bound = x64.abs() * 2.0**-4 + scale.double() * 2.0**-10 + x64.abs() * 1e-6
    err = (back - x64).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((back[5] == 0).all()) and not bool(back.isnan().any())
    rel = (err / x64.abs().clamp(min=1e-300))[x64.abs() > amax * 2.0**-6]
    assert 0.005 < float(rel.mean()) < 2.0**-4, "the round trip must really lose precision (≈ 2% mean)"
    # and it agrees with the format's definition, written out independently above
    torch.testing.assert_close(back, fake_quant_rows(x.double()), rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def reference_fp8_model(tiny_model_dir):
    """The HF model in float64 whose every decoder linear layer computes fq(x) @ fq(W)ᵀ with `fake_quant_rows`
    (per-token activations, per-output-channel weights); the LM head and embeddings unquantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()
    head = model.get_output_embeddings()

    def quantized_forward(layer):
        weight = fake_quant_rows(layer.weight.detach())

        def forward(x):
            out = fake_quant_rows(x) @ weight.t()
            return out if layer.bias is None else out + layer.bias

        return forward

    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.forward = quantized_forward(module)
            count += 1
    assert count == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down
    return model


def engine_logprobs(out) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)


def reference_logprobs(model, prompt, output_ids) -> torch.Tensor:
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def test_fp8_engine_logprobs_equal_an_independent_reference_of_the_scheme(
    tiny_model_dir, reference_fp8_model
):
    """fp32 engine + FP8 linears (KV-cached decoding) against the float64 reference (uncached full forward):
    equal to fp32 rounding, while the unquantized model is an order of magnitude further away."""
    from transformers import AutoModelForCausalLM

    engine = LocalEngine(tiny_model_dir, dtype="float32", quantization="fp8")
    assert isinstance(engine.model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert not isinstance(engine.model.lm_head, Fp8Linear)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()
    items = [
        item("a", [5, 6, 76, 7, 84], temperature=1.0, log_rho=None, seed=1, max_new_tokens=16),
        item("b", [9, 84], temperature=1.0, log_rho=None, seed=2, max_new_tokens=16),
    ]
    for it, out in zip(items, engine.generate(items), strict=True):
        got = engine_logprobs(out)
        ref = reference_logprobs(reference_fp8_model, it.input_ids, out["output_ids"])
        unquantized = reference_logprobs(plain, it.input_ids, out["output_ids"])
        gap = float((got - ref).abs().max())
        assert gap < 1e-4, gap  # measured ≈ 9e-7
        assert float((unquantized - ref).abs().max()) > 10 * gap, "FP8 must change the log-probs measurably"


def test_weight_updates_are_requantized(tiny_model_dir, perturbed_model_dir):
    """After a disk update and after a partial in-memory update, the FP8 weights are those of the new
    weights (the stale ones would give different outputs)."""
    engine = LocalEngine(tiny_model_dir, dtype="bfloat16", quantization="fp8")
    down = engine.model.model.layers[1].mlp.down_proj
    before = down.weight_fp8.float().clone()
    engine.update_weights_from_disk(str(perturbed_model_dir), "1")
    new = read_safetensors_dir(perturbed_model_dir)
    q, scale = quantize_rows(new["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16))
    assert torch.equal(down.weight_fp8.float(), q.float()) and torch.equal(down.weight_scale, scale)
    assert not torch.equal(before, q.float())
    # a bucket with one tensor: only that layer is re-derived, from the copied (bf16) values
    update = torch.randn_like(new["model.layers.0.self_attn.o_proj.weight"]) * 3
    engine.load_named_tensors([("model.layers.0.self_attn.o_proj.weight", update)], "2")
    o_proj = engine.model.model.layers[0].self_attn.o_proj
    q, scale = quantize_rows(update.to(torch.bfloat16))
    assert torch.equal(o_proj.weight_fp8.float(), q.float()) and torch.equal(o_proj.weight_scale, scale)
    assert engine.weight_version == "2"


def test_dvp_safe_set_is_the_ops_rule_on_the_fp8_engines_own_logits(tiny_model_dir):
    """The processor prunes the FP8 engine's logits exactly to {v : op says v ∈ V_S} and the returned
    log-probs are the op's log π^mp on those same logits (bf16 model, FP8 linears)."""
    engine = LocalEngine(tiny_model_dir, dtype="bfloat16", quantization="fp8")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    sample = engine.batcher.sample

    def recording_sample(rows, logits):
        raw = logits.clone()
        result = sample(rows, logits)  # processes `logits` in place
        seen.append((raw, logits.clone()))
        return result

    engine.batcher.sample = recording_sample
    log_rho, temperature = -4.0, 0.8
    it = item("a", [5, 6, 76, 7, 84], temperature=temperature, log_rho=log_rho, seed=4, max_new_tokens=12)
    (out,) = engine.generate([it])
    raw = torch.cat([r for r, _ in seen])  # [steps, V]
    processed = torch.cat([p for _, p in seen])
    vocab = raw.shape[-1]
    pruned = 0
    for row in range(raw.shape[0]):
        every_token = vocab_parallel_masked_logprobs(
            raw[row].expand(vocab, vocab), torch.arange(vocab), log_rho=log_rho, temperature=temperature
        )
        kept = ~torch.isneginf(processed[row])
        assert torch.equal(kept, every_token.in_safe_set)
        pruned += int((~kept).sum())
    assert pruned > 0, "log_rho=-4 must prune on this model"
    op = vocab_parallel_masked_logprobs(
        raw, torch.tensor(out["output_ids"]), log_rho=log_rho, temperature=temperature
    )
    assert bool(op.in_safe_set.all())
    torch.testing.assert_close(engine_logprobs(out).float(), op.logprobs, atol=1e-5, rtol=0)
    assert not math.isnan(float(op.logprobs.sum()))
