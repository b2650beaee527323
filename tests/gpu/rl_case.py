"""The RL batch of the CUDA-vs-CPU trainer test: a tiny random Qwen3 on disk and 16 (prompt, response)
samples with the engine's log-probs and advantages, built on the host in float64 (no trainer involved).

The responses are chosen so that no response token lies within `MARGIN` (raw logit) of the DVP threshold
max − |log ρ|: the bf16 trainer and the fp32 one then agree on which targets are in the safe set, and the
test compares numerics, not a coin flip at the boundary. Engine log-probs are log π^mp plus fixed
noise: the worker sets them each step from the trainer's own θ_old log-probs plus the sample's fixed
`engine_noise` (N(0, 0.1²), importance weights within MIS's [0.5, 2] by a wide margin; one token in each
of four samples off by 3 nats, so MIS rejects it), as an engine synced to the step's weights would return
them. Both runs then take the same MIS decisions, whatever their rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tail.train import Sample
from tests.model.hf_models import hf_logits, make_hf_model

MARGIN = 0.3
N_SAMPLES = 16


def _logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float64 logits `[len(response), V]` of the positions that predict the response."""
    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        return hf_logits(model, tokens)[0, len(prompt) - 1 : -1].double()


def _away_from_the_threshold(model, prompt, response, log_rho) -> list[int]:
    """`response` with each token too close to the safe-set threshold replaced by the position's argmax
    (left to right: a replacement changes the later positions' logits)."""
    response = list(response)
    for j in range(len(response)):
        z = _logits(model, prompt, response)[j]
        threshold = z.max() + log_rho
        if abs(float(z[response[j]] - threshold)) < MARGIN:  # some runs only: none in this host-built case
            response[j] = int(z.argmax())
    return response


def build_case(root: Path, log_rho: float) -> dict:
    """{'hf_dir', 'samples'}: the model saved under `root/hf` and the samples with their fields."""
    hf = make_hf_model("qwen3", root / "hf")
    g = torch.Generator().manual_seed(11)
    samples = []
    for i in range(N_SAMPLES):
        prompt = torch.randint(0, 200, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist()
        raw = torch.randint(0, 200, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist()
        response = _away_from_the_threshold(hf, prompt, raw, log_rho)
        noise = 0.1 * torch.randn(len(response), generator=g)
        if i % 4 == 0:
            noise[len(response) // 2] -= 3.0  # weight e^3 > 2: rejected by MIS
        advantage = torch.full(noise.shape, float(torch.randn((), generator=g)))
        fields = {"engine_noise": noise, "advantages": advantage, "rollout_logprobs": torch.zeros_like(noise)}
        samples.append(Sample(prompt, response, fields))
    return {"hf_dir": str(root / "hf"), "samples": samples}
