"""MoE with routing replay on CUDA: a tiny Qwen3-MoE (`moe_case`) whose rollout batch a CUDA local engine
sampled in fp32 with its routes (its routers a little off the trainer's, as an engine a version behind: the
routes differ from the trainer's own choice on a sixth of the pairs); two RL steps under
`algorithm.routing_replay: r3` on one GPU (NCCL, world size 1, megatron's "alltoall" token dispatcher at
EP = 1, bf16, full recompute, the distributed optimizer) equal the same steps of a CPU fp32 run (gloo,
"allgather") within the dense check's tolerances (`test_trainer_cuda`). Each trainer run is a process of
its own (`moe_worker`). Checked on both runs:

- r3 replays the engine's routes: every router call of the θ_old and update passes (recomputed forwards
  included) used exactly the engine's top-k set on every routed (position, MoE layer), and the fp32 run's
  θ_old log-probs equal a float64 HF forward with the engine's routes forced into its MoE layers;
- `moe/routing_agreement` (the trainer's own routers against the engine's routes, in the replayed pass)
  read back from the step's diagnostics: the float64 forward's agreement, up to the pairs whose top-k margin
  the run's rounding can tip (`FLIP_MARGIN`; the fp32 run at θ_0: `FP32_FLIP_MARGIN`, i.e. exactly here);
- the loss equals the float64 objective at ratio 1 from the run's own θ_old log-probs, and both runs take
  the same discrete decisions (MIS zero weights, vetoes, tokens out of the safe set);
- gradient norms and the fp32 main-parameter update within the dense tolerances;
- the aux loss's scale as `tests/train/test_moe_aux_loss_scale.py` checks it on CPU: with the RL loss zeroed,
  the last router's `main_grad` equals coeff × ∇ of the token-weighted Switch loss recomputed in float64.

The loss is not compared between the runs: at ratio 1 it is −Σ A·w / N with w = π_θold / π_engine, and the
engine's log-probs are real here (the dense check derives them from each run's own θ_old), so the two
runs' losses differ by their θ_old's rounding, Σ |A|·|Δw| / N, not by a mistake.

Its CPU half, the same code with the engine, and both runs, on the CPU (fp32 against bf16, the comparison
the dense tolerances were calibrated on): `tests/train/test_moe_rl_device.py`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.common import record_rows
from tests.gpu.test_trainer_cuda import GRAD_NORM_RTOL, UPDATE_MIN_COSINE, UPDATE_RTOL, _main_update

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/train/test_moe_rl_device.py"
ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-3
"""The dense check's loss tolerance, here against the float64 objective of the run's own θ_old."""
FLIP_MARGIN = 0.25
"""Router-logit gap (k-th to (k+1)-th expert, float64) below which a bf16 run may pick another top-k set. bf16
keeps 8 significant bits: the router's logits are rounded to bf16 (`moe_router_dtype` is unset, so megatron's
`router_gating_linear` runs in the input dtype; here |z| ≤ 19, so up to 19·2⁻⁹ ≈ 0.04 each) after three layers
of bf16 weights and activations (2⁻⁹ relative each), and the second step's θ_old moved by at most lr per entry
(Adam with ε = 1). A quarter of a logit covers them with room; 7% of the CPU case's 400 pairs are under it."""
FP32_FLIP_MARGIN = 1e-3
"""The same for the fp32 run's first step (θ_0, the float64 reference's weights): its router logits are within
~1e-5 of float64's, so only a pair closer to a tie than this could differ (the CPU case's smallest margin is
0.03: the agreement is float64's exactly)."""
AUX_LOSS_RTOL = 2e-2
"""`moe/aux_loss`, bf16 against fp32: E/(k·T²)·Σ_e (Σ_x p_xe)·count_e over the 36–64 tokens of a
micro-batch, each p off by up to ≈ 4% (bf16 logits, see `AUX_RTOL_BF16`) with errors of both signs (a top-k
count that a near-tie moves changes it by (p_e − p_e')/(k·T), next to nothing). Measured on CPU: 3e-3."""
LOGPROB_ATOL_FP32 = 1e-4
"""The fp32 run's first θ_old log-probs against the float64 forward with the engine's routes forced
(`moe_case.forced_reference`): the local engine tests' per-token tolerance against an fp32 forward."""
MIN_REPLAYED_DIFFERENCE = 0.05
"""The engine's routes must differ from the trainer's own (float64) choice on at least 5% of the pairs, or a
replay that did not happen could pass (the CPU case: 18%)."""
AUX_RTOL_FP32 = 1e-4
"""`test_moe_aux_loss_scale`'s tolerance (fp32 on CPU)."""
AUX_RTOL_BF16 = 3e-2
"""‖got − expected‖ / ‖expected‖ for a bf16 run. Its router logits are rounded to bf16 (up to ≈ 0.04
absolute at |z| ≤ 19), which moves each softmax probability by up to ≈ 4% relative, and the weight gradient
(`router_gating_linear`'s backward, bf16) is rounded once more (2⁻⁹); summed over the step's ≈ 220 router
tokens the errors partly cancel. The float64 reference takes the counts (constants in the gradient) from the
router's own routing maps, so a near-tie that bf16 orders otherwise does not count against it. Measured on
CPU bf16: 3e-3 (fp32: 6e-7)."""


def run_worker(case: Path, out: Path, precision: str, *, cuda: bool) -> dict:
    """`python -m tests.gpu.moe_worker CASE OUT --precision P` in a process of its own; on the CPU
    (`CUDA_VISIBLE_DEVICES=""`, gloo and the CPU patches) unless `cuda`. Returns what it wrote."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "4",
    }
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.moe_worker", str(case), str(out), "--precision", precision],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"moe_worker --precision {precision} failed:\n{done.stderr[-4000:]}"
    return torch.load(out, weights_only=False)


def moe_runs(root: Path, device: str) -> tuple[dict, dict, dict]:
    """(case, fp32 CPU run, bf16 run): the engine and the bf16 run on `device`, the fp32 run on the CPU."""
    from tests.gpu.moe_case import build_moe_case

    case = build_moe_case(root, device)
    torch.save(case, root / "case.pt")
    reference = run_worker(root / "case.pt", root / "fp32.pt", "fp32", cuda=False)
    run = run_worker(root / "case.pt", root / "bf16.pt", "bf16", cuda=device == "cuda")
    return case, reference, run


def expected_loss(case: dict, theta_old: dict[int, torch.Tensor]) -> float:
    """The step's `train/loss` in float64 from the run's θ_old log-probs (one update, ratio 1): PPO's
    −min(r·A, clip(r)·A) = −A, times MIS's token weight w = π_old/π_engine (0 outside [mis_low, mis_high],
    a sequence with a weight under the veto threshold dropped), token-mean over the tokens with w > 0."""
    from megatron_tail.train.rl.samples import build_samples
    from tests.gpu.moe_worker import run_config

    cfg = run_config(case["hf_dir"], "fp32")
    algo = cfg.algorithm
    total, tokens = 0.0, 0
    for i, sample in enumerate(build_samples(cfg, case["batch"]).samples):
        w = torch.exp(theta_old[i] - sample.fields["rollout_logprobs"].double())
        if bool((w < algo.veto_threshold).any()):  # some runs only: a vetoed sequence (none in the CPU case)
            continue
        w = torch.where((w >= algo.mis_low) & (w <= algo.mis_high), w, torch.zeros_like(w))
        total += float((-sample.fields["advantages"].double() * w).sum())
        tokens += int((w > 0).sum())
    return total / tokens


def check_moe_runs(case: dict, reference: dict, run: dict) -> dict[str, float]:
    """Every check of the module docstring but the aux scale, on the fp32 `reference` and the bf16 `run`;
    returns the measured numbers (the table's)."""
    pairs, margins = case["pairs"], case["margins"]
    expected_agreement = float(case["own_agrees"].double().mean())
    # the engine's routes differ from the trainer's own choice often enough that replay shows
    assert 1.0 - expected_agreement >= MIN_REPLAYED_DIFFERENCE, expected_agreement
    assert reference["params_dtype"] == "torch.float32" and run["params_dtype"] == "torch.bfloat16"
    for r in (reference, run):
        assert r["dispatcher"] == ("alltoall" if r["device"].startswith("cuda") else "allgather")
        for step, s in enumerate(r["steps"]):
            m = s["metrics"]
            # r3: every router call of both passes used the engine's routes (update: forward + recompute)
            assert s["old_replay"] == {"pairs": pairs, "misses": 0}, (step, s["old_replay"])
            assert s["update_replay"] == {"pairs": 2 * pairs, "misses": 0}, (step, s["update_replay"])
            # the routers' own choice against the engine's, as float64 sees it up to the pairs that the
            # run's rounding (and the first update) can tip
            margin = FP32_FLIP_MARGIN if (r is reference and step == 0) else FLIP_MARGIN
            slack = float((margins < margin).double().mean())
            got = m["moe/routing_agreement"]
            assert abs(got - expected_agreement) <= slack + 1e-12, (step, got, expected_agreement, slack)
            assert {"moe/routing_agreement/layer_0", "moe/routing_agreement/layer_2"} <= m.keys()
            assert math.isfinite(m["moe/aux_loss"]) and m["moe/aux_loss"] > 0
            assert m["train/loss"] == pytest.approx(
                expected_loss(case, s["theta_old"]), rel=LOSS_RTOL, abs=1e-6
            )
    # the fp32 trainer's θ_old under r3: the float64 forward with the engine's routes forced
    ref = case["reference_logprobs"]
    theta_old = reference["steps"][0]["theta_old"]
    assert theta_old.keys() == ref.keys()
    logprob_error = max(float((theta_old[i] - ref[i]).abs().max()) for i in ref)
    assert logprob_error < LOGPROB_ATOL_FP32, logprob_error
    decisions = ("is/zero_weight_fraction", "is/vetoed_fraction", "train/out_of_safe_set_fraction")
    for step, (c, g) in enumerate(zip(reference["steps"], run["steps"], strict=True)):
        c, g = c["metrics"], g["metrics"]
        assert c["train/skipped_updates"] == g["train/skipped_updates"] == 0.0
        for key in decisions:
            assert g[key] == c[key], (step, key)
        assert g["train/grad_norm"] == pytest.approx(c["train/grad_norm"], rel=GRAD_NORM_RTOL), step
        assert g["moe/aux_loss"] == pytest.approx(c["moe/aux_loss"], rel=AUX_LOSS_RTOL), step
    dc, dg = _main_update(reference), _main_update(run)
    assert dc.keys() == dg.keys() and all(dc[k].shape == dg[k].shape for k in dc)
    diff = sum(float(((dc[k] - dg[k]) ** 2).sum()) for k in dc) ** 0.5
    norm_c = sum(float((dc[k] ** 2).sum()) for k in dc) ** 0.5
    norm_g = sum(float((dg[k] ** 2).sum()) for k in dg) ** 0.5
    cosine = sum(float((dc[k] * dg[k]).sum()) for k in dc) / (norm_c * norm_g)
    assert diff / norm_c < UPDATE_RTOL and cosine > UPDATE_MIN_COSINE, (diff / norm_c, cosine)
    steps = list(zip(reference["steps"], run["steps"], strict=True))
    return {
        "grad_norm_rel_diff": max(
            abs(g["metrics"]["train/grad_norm"] / c["metrics"]["train/grad_norm"] - 1) for c, g in steps
        ),
        "update_rel_diff": diff / norm_c,
        "update_cosine": cosine,
        "agreement_float64": expected_agreement,
        # the lowest a bf16 run's agreement may read: float64's, less the pairs its rounding can tip
        "agreement_floor": expected_agreement - float((margins < FLIP_MARGIN).double().mean()),
        "agreement_fp32": [s["metrics"]["moe/routing_agreement"] for s in reference["steps"]],
        "agreement_bf16": [s["metrics"]["moe/routing_agreement"] for s in run["steps"]],
        "fp32_logprob_error": logprob_error,
        "aux_loss_rel_diff": max(
            abs(g["metrics"]["moe/aux_loss"] / c["metrics"]["moe/aux_loss"] - 1) for c, g in steps
        ),
    }


def _switch_aux_counts(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, topk: int
) -> torch.Tensor:
    """`test_moe_aux_loss_scale._switch_aux` with the top-k counts `[E]` given (the router's own routing
    map's): float64, `x [T, h]`, `weight [E, h]`."""
    scores = torch.softmax(x @ weight.t(), dim=-1)
    num_tokens, num_experts = scores.shape
    return num_experts / (topk * num_tokens**2) * (scores.sum(0) * counts).sum()


def aux_errors(aux: dict) -> dict[str, float]:
    """The aux check of one run (`moe_worker.aux_step`): ‖got − expected‖ / ‖expected‖ against coeff × ∇ of
    the token-weighted mean over micro-batches of megatron's Switch loss in float64, with the top-k counts
    recomputed in float64 (`_switch_aux`, "recomputed") and with the router's own routing maps ("own")."""
    from tests.rollout.tiny_moe import TOP_K
    from tests.train.test_moe_aux_loss_scale import _switch_aux

    got = aux["main_grad"].double()
    out = {}
    for name in ("recomputed", "own"):
        weight = aux["weight"].clone().requires_grad_(True)
        weighted, tokens = 0.0, 0
        for x, routing_map in zip(aux["inputs"], aux["routing_maps"], strict=True):
            if name == "recomputed":
                part = _switch_aux(x, weight, TOP_K)
            else:
                part = _switch_aux_counts(x, weight, routing_map.double().sum(0), TOP_K)
            weighted, tokens = weighted + x.shape[0] * part, tokens + x.shape[0]
        (grad,) = torch.autograd.grad(weighted, weight)
        expected = aux["coeff"] * grad / tokens
        assert expected.norm() > 1e-6
        out[name] = float((got - expected).norm() / expected.norm())
        out[f"{name}_expected"] = expected
    return out


def check_aux_scale(aux: dict, *, bf16: bool) -> float:
    """Asserts the aux check (`aux_errors`) within the precision's tolerance; returns the relative error
    against the router's-own-counts reference."""
    errors = aux_errors(aux)
    if bf16:
        assert errors["own"] < AUX_RTOL_BF16, errors["own"]
    else:  # as the CPU test: elementwise, and both references agree (no near-tie in fp32)
        for name in ("recomputed", "own"):
            expected = errors[f"{name}_expected"]
            torch.testing.assert_close(
                aux["main_grad"].double(),
                expected,
                rtol=AUX_RTOL_FP32,
                atol=1e-6 * expected.abs().max().item(),
            )
    return errors["own"]


def moe_rows(n: dict[str, float], run: dict) -> list[dict]:
    """The table's rows of `check_moe_runs`'s numbers `n` for the bf16 `run` against the CPU fp32 one."""
    device = "CUDA" if run["device"].startswith("cuda") else "CPU"
    value = (
        f"grad norm rel. diff {n['grad_norm_rel_diff']:.2e}; update rel. diff {n['update_rel_diff']:.2e}, "
        f"cosine {n['update_cosine']:.6f}"
    )
    agreement = ", ".join(f"{a:.4f}" for a in n["agreement_bf16"])
    fp32 = ", ".join(f"{a:.4f}" for a in n["agreement_fp32"])
    return [
        {
            "what": f"MoE r3 ({run['dispatcher']}, EP 1): 2 RL steps, {device} bf16 vs CPU fp32",
            "value": value,
        },
        {
            "what": f"MoE routing agreement with the {device} engine, by step",
            "value": f"bf16 {agreement} (floor {n['agreement_floor']:.4f}); CPU fp32 {fp32}",
        },
    ]


def check_and_record_steps(runs: tuple[dict, dict, dict], device: str, record_property) -> dict[str, float]:
    """The engine on `device`, the bf16 run on it, the fp32 run on the CPU: `check_moe_runs`, then its rows
    into the table; returns the numbers."""
    case, reference, run = runs
    assert case["engine_device"] == device and reference["device"] == "cpu"
    assert run["device"].startswith(device)
    numbers = check_moe_runs(case, reference, run)
    record_rows(record_property, moe_rows(numbers, run))
    return numbers


def check_and_record_aux(runs: tuple[dict, dict, dict], record_property) -> tuple[float, float]:
    """`check_aux_scale` on both runs, and its row; returns the two relative errors (fp32, bf16)."""
    _, reference, run = runs
    fp32 = check_aux_scale(reference["aux"], bf16=False)
    bf16 = check_aux_scale(run["aux"], bf16=True)
    device = "CUDA" if run["device"].startswith("cuda") else "CPU"
    row = {
        "what": "MoE aux-loss gradient vs float64, rel. error",
        "value": f"{device} bf16 {bf16:.2e}; CPU fp32 {fp32:.2e}",
    }
    record_rows(record_property, [row])
    return fp32, bf16


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    return moe_runs(tmp_path_factory.mktemp("moe_cuda"), "cuda")


def test_r3_steps_on_cuda_equal_the_cpu_fp32_steps(cuda_runs, record_property):
    check_and_record_steps(cuda_runs, "cuda", record_property)


def test_aux_loss_scale_on_cuda(cuda_runs, record_property):
    check_and_record_aux(cuda_runs, record_property)
