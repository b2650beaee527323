"""The demo with `--set rollout.sampling.top_p=0.8 --set rollout.sampling.top_k=20` against the untruncated
demo (3 RL steps each, one pretraining shared through the cache): slow. Its cheap CI slice is
`test_truncated_sampling_loop`.

Scoring truncated samples with the full distribution would put the mismatch KL near −log(kept mass)
(`mismatch/truncation_bias`); replaying the support keeps it at the untruncated demo's bf16 level."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_tail.demo.run import read_scalars


def _demo(tmp_path, name: str, *sets: str) -> dict[str, dict[int, float]]:
    cmd = [sys.executable, "-m", "megatron_tail.cli", "demo", "--run-dir", str(tmp_path / name)]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--set", "train.steps=3", "--set", "train.eval_every=0"]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {tag: dict(values) for tag, values in read_scalars(tmp_path / name).items()}


@pytest.mark.slow
def test_truncated_demo_keeps_the_untruncated_mismatch(tmp_path):
    plain = _demo(tmp_path, "plain")
    truncated = _demo(tmp_path, "truncated", "rollout.sampling.top_p=0.8", "rollout.sampling.top_k=20")
    steps = (1, 2, 3)
    kl_plain = max(plain["mismatch/kl_infer_train_k3"][s] for s in steps)
    kl_truncated = max(truncated["mismatch/kl_infer_train_k3"][s] for s in steps)
    bias = min(truncated["mismatch/truncation_bias"][s] for s in steps)
    assert bias > 20 * max(kl_plain, 1e-4), "top_p = 0.8 drops real mass"
    assert kl_truncated < 3 * max(kl_plain, 1e-4), (kl_truncated, kl_plain)
    assert all(1.0 <= truncated["rollout/support_size_mean"][s] <= 20.0 for s in steps)
