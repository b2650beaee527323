"""The local engine's mismatch dial (issue 26): FP8 per-tensor linear layers, NVFP4 W4A16 weights, the FP8
KV cache and the synthetic tail-shaped logit noise, each against a float64 implementation written here from
the format's definition (e4m3 rounding from `test_fp8_engine.e4m3_round`, e2m1 from its value set), not the
production code; the engine serves each format and re-quantizes on weight updates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.fp4 import Nvfp4Linear, nvfp4_dequantized
from megatron_tail.rollout.local_engine.fp8 import Fp8Linear
from megatron_tail.rollout.local_engine.kv_cache import Fp8KVCache
from megatron_tail.rollout.local_engine.logit_noise import add_tail_logit_noise_
from megatron_tail.rollout.local_engine.weights import read_safetensors_dir
from tests.rollout.test_fp8_engine import e4m3_round

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """float64 → nearest e2m1 value by exhaustive distance to the value set (ties to the smaller)."""
    distance = (v.abs().clamp(max=6.0)[..., None] - E2M1).abs()
    return E2M1[distance.argmin(dim=-1)] * v.sign()


def nvfp4_reference(w: torch.Tensor) -> torch.Tensor:
    """float64 NVFP4 round trip: global scale amax/(448·6), e4m3 scale per 16 inputs, e2m1 elements."""
    n, k = w.shape
    g = w.reshape(n, k // 16, 16)
    global_scale = g.abs().max() / (448.0 * 6.0)
    block = e4m3_round(g.abs().amax(dim=-1, keepdim=True) / 6.0 / global_scale) * global_scale
    return (e2m1_round(g / block) * block).reshape(n, k)


def test_nvfp4_round_trip_equals_the_float64_definition():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]
    w[3, 5] = 40.0  # one outlier sets the global scale
    got = nvfp4_dequantized(w).double()
    want = nvfp4_reference(w.double())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # every element is an e2m1 value times its block's scale: at most 8 magnitudes per block of 16
    assert all(len(torch.unique(b.abs())) <= 8 for b in got.reshape(-1, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_dequantized(torch.ones(4, 24))


def test_nvfp4_linear_multiplies_unquantized_activations_and_requantizes():
    torch.manual_seed(1)
    linear = nn.Linear(32, 16, bias=True)
    layer = Nvfp4Linear(linear)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    want = x.double() @ nvfp4_reference(linear.weight.detach().double()).t() + linear.bias.detach().double()
    torch.testing.assert_close(layer(x).double(), want.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        linear.weight.mul_(2.0)
    layer.requantize()
    torch.testing.assert_close(
        layer._weight_dequantized.double(), nvfp4_reference(linear.weight.detach().double())
    )


def test_fp8_per_tensor_has_one_scale_for_weight_and_activations():
    torch.manual_seed(2)
    linear = nn.Linear(24, 8, bias=False)
    layer = Fp8Linear(linear, per_tensor=True)
    assert layer.weight_scale.numel() == 1
    x = torch.randn(6, 24) * torch.logspace(-2, 1, 6)[:, None]
    w = linear.weight.detach().double()
    sw = w.abs().max() / 448.0
    sx = x.double().abs().max() / 448.0
    want = (e4m3_round(x.double() / sx) * sx) @ (e4m3_round(w / sw) * sw).t()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6)
    # per-tensor loses more of the small rows than per-channel (one scale for rows spanning 3 decades)
    per_row = Fp8Linear(linear)
    exact = x.double() @ w.t()
    assert (layer(x).double() - exact).abs()[0].max() > (per_row(x).double() - exact).abs()[0].max()


def test_fp8_kv_cache_stores_and_returns_e4m3_values_at_scale_one():
    cache = Fp8KVCache()
    g = torch.Generator().manual_seed(3)
    k1, v1 = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g) * 1e-3
    k2, v2 = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
    cache.update(k1, v1, 0)
    keys, values = cache.update(k2, v2, 0)
    torch.testing.assert_close(keys.double(), e4m3_round(torch.cat([k1, k2], dim=2).double()))
    torch.testing.assert_close(values.double(), e4m3_round(torch.cat([v1, v2], dim=2).double()))
    assert keys.dtype == torch.float32 and keys.shape == (2, 2, 4, 8)


def test_logit_noise_is_sigma_times_one_minus_p_times_the_generators_normals():
    logits = torch.tensor([8.0, 1.0, 0.0, -3.0, -9.0])
    got = add_tail_logit_noise_(logits.clone(), 1.5, torch.Generator().manual_seed(7))
    z = logits.double()
    p = torch.softmax(z, dim=0)
    normals = torch.randn(5, generator=torch.Generator().manual_seed(7), dtype=torch.float32).double()
    torch.testing.assert_close(got.double(), z + 1.5 * (1 - p) * normals, rtol=1e-6, atol=1e-6)
    # the head (p ≈ 0.999) is nearly exact, the tail gets the full σ
    assert abs(float(got[0] - logits[0])) < 1.5 * 2e-3 * 5
    assert torch.equal(add_tail_logit_noise_(logits.clone(), 0.0, torch.Generator()), logits)


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("fp8_tensor", "auto"), ("nvfp4_a16", "auto"), ("none", "fp8_e4m3")]
)
def test_engine_serves_each_format_and_requantizes_after_updates(
    tiny_model_dir, perturbed_model_dir, quantization, kv_cache_dtype
):
    """The first (prefill) token's greedy log-prob differs from the bf16 engine's (the format acts) but stays
    close (it is the same model); after loading new weights the quantized layers derive from them."""
    from tests.rollout.test_local_engine import item

    def greedy(engine):
        out = engine.generate([item("r", [3, 4, 5], temperature=0.0, log_rho=None, seed=0, max_new_tokens=6)])
        return [x[0] for x in out[0]["meta_info"]["output_token_logprobs"]]

    plain = LocalEngine(tiny_model_dir, dtype="bfloat16")
    quant = LocalEngine(
        tiny_model_dir, dtype="bfloat16", quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    la, lb = greedy(plain), greedy(quant)
    assert la[0] != lb[0] and abs(la[0] - lb[0]) < 0.5, (la[0], lb[0])
    if quantization != "none":
        quant.update_weights_from_disk(str(perturbed_model_dir))
        name, layer = next((n, m) for n, m in quant.model.named_modules() if hasattr(m, "requantize"))
        new = read_safetensors_dir(str(perturbed_model_dir))[f"{name}.weight"].float()
        torch.testing.assert_close(layer.weight.detach().float(), new.to(layer.weight.dtype).float())
        if quantization == "nvfp4_a16":
            torch.testing.assert_close(layer._weight_dequantized, nvfp4_dequantized(layer.weight.detach()))


def test_engine_refuses_unknown_formats(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LocalEngine(tiny_model_dir, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="logit_noise"):
        LocalEngine(tiny_model_dir, logit_noise=-1.0)


def test_local_engine_command_and_config_carry_the_dial():
    from megatron_tail.config import load_config
    from megatron_tail.rollout.launch import LocalEngineConfig, build_local_engine_command
    from megatron_tail.utils.errors import UserError

    cmd = build_local_engine_command(
        LocalEngineConfig(
            model_path="m", quantization="nvfp4_a16", kv_cache_dtype="fp8_e4m3", logit_noise=2.0
        )
    )
    assert cmd[cmd.index("--quantization") + 1] == "nvfp4_a16"
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert float(cmd[cmd.index("--logit-noise") + 1]) == 2.0
    assert "--kv-cache-dtype" not in build_local_engine_command(LocalEngineConfig(model_path="m"))
    cfg = load_config(None, ["rollout.local.logit_noise=1.5", "rollout.local.kv_cache_dtype=fp8_e4m3"])
    assert cfg.rollout.local.logit_noise == 1.5
    remote = ["rollout.engine=remote", "rollout.server_urls=[http://h:1]"]
    with pytest.raises(UserError, match="local-engine emulation"):
        load_config(None, [*remote, "rollout.quantization=nvfp4_a16"])
    with pytest.raises(UserError, match="local engine only"):
        load_config(None, [*remote, "rollout.local.logit_noise=1.0"])
    for bad in ("-1", "inf"):
        with pytest.raises(
            UserError, match=rf"rollout\.local\.logit_noise must be a finite number ≥ 0.*{bad}"
        ):
            load_config(None, [f"rollout.local.logit_noise={bad}"])
