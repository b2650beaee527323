"""Partial rollouts on the local engine (fp32, in-process server): a weight update in the middle of a
generation pauses it (`/pause_generation` abort), the client continues each sample from its tokens under
the new weights, and every token keeps the log-prob and version of the weights that sampled it — checked
against independent full-sequence forwards of the old and the new model. Also the engine's continuous
batching (a sequence that joins a running batch gets the tokens it gets alone) and its retract mode (KV
recomputed with the new weights)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from megatron_tail.rollout import DiskWeightSync, RolloutClient, SamplingConfig
from megatron_tail.rollout.batch import RolloutBatch, rollout_metrics
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.server import build_app
from megatron_tail.rollout.processor import DVPLogitProcessor
from megatron_tail.rollout.protocol import sample_keys
from tests.rollout.servers import serving_app
from tests.rollout.test_local_engine import item, reference_logprobs

LOG_RHO = -4.0
PROMPT = [5, 6, 84, 7]


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _pause_at_tokens(engine: LocalEngine, n: int, mode: str) -> None:
    """Pause the engine (`mode`) from its own batcher thread, right after the decoding step at which every
    running sequence has `n` tokens: the hold lands at that step on a loaded machine too, where a test
    thread that polls for `n` tokens and then pauses can be overtaken by the rest of a short generation.
    Install it before the generation starts."""
    batcher = engine.batcher
    step = batcher._decode_step

    def step_then_pause() -> None:
        step()
        rows = list(batcher.running)
        if rows and all(len(r.outputs) >= n for r in rows):
            del batcher._decode_step  # once: the class's method again
            engine.control.pause(mode)

    batcher._decode_step = step_then_pause


def _hold(engine: LocalEngine, mode: str | None, timeout_s: float = 60.0) -> None:
    """Pause the engine (`mode`; None: a pause already asked for, e.g. by `_pause_at_tokens`) and wait until
    its batcher holds for it, between two decoding steps (`pause_in_force`)."""
    if mode is not None:
        engine.control.pause(mode)
    deadline = time.monotonic() + timeout_s
    while not engine.batcher.pause_in_force():
        if time.monotonic() > deadline:
            raise TimeoutError("the batcher did not stop")
        time.sleep(0.001)


def _run_then_close(engine: LocalEngine, main):
    """`asyncio.run(main())`'s result; the engine is closed however it ended."""
    try:
        return asyncio.run(main())
    finally:
        engine.close()


async def _held_group(engine: LocalEngine, client: RolloutClient, sampling: SamplingConfig, at_tokens: int):
    """Start one partial group's generation (`PROMPT`, keys of group 0) and return its task once the batch is
    held, by the engine's own thread (`_pause_at_tokens`, in place), between the two decoding steps at which
    every row has `at_tokens` tokens: no row has finished, and a weight update can follow."""
    _pause_at_tokens(engine, at_tokens, "in_place")
    task = asyncio.ensure_future(
        client.generate_group(PROMPT, sample_keys(0, sampling), sampling, partial=True)
    )
    await asyncio.to_thread(_hold, engine, None)
    return task


def test_partial_rollout_keeps_each_tokens_version_and_behaviour_logprob(tiny_model_dir, perturbed_model_dir):
    old, new = _model(tiny_model_dir), _model(perturbed_model_dir)
    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="0")
    sampling = SamplingConfig(
        n_samples=8, max_new_tokens=40, temperature=1.0, log_rho=LOG_RHO, ignore_eos=True, base_seed=11
    )

    async def main():
        async with serving_app(build_app(engine)) as url:
            client = RolloutClient([url], processor=DVPLogitProcessor.to_str())
            # the batch held where it is at 6 tokens (by the engine's own thread: never finished first),
            # then the weight update a trainer step ends with: pause (abort) → load → continue
            task = await _held_group(engine, client, sampling, 6)
            await DiskWeightSync([url]).update(str(perturbed_model_dir), weight_version="1")
            samples = await task
            await client.close()
            return samples

    samples = _run_then_close(engine, main)
    for s in samples:
        assert len(s.output_ids) == 40 and s.finish_reason["type"] == "length"
        versions = [int(v) for v in s.columns["token_versions"]]
        cut = versions.index(1)
        assert cut >= 6 and versions == [0] * cut + [1] * (40 - cut) and s.segments == 2
        for model, part in ((old, slice(0, cut)), (new, slice(cut, 40))):
            want = reference_logprobs(model, PROMPT, s.output_ids, log_rho=LOG_RHO, temperature=1.0)
            got = torch.tensor(s.columns["rollout_logprobs"])[part]
            torch.testing.assert_close(got, want.logprobs[part], rtol=1e-4, atol=1e-4)
        # the old tokens are not the new model's: the test can tell the versions apart
        new_lp = reference_logprobs(new, PROMPT, s.output_ids, log_rho=LOG_RHO, temperature=1.0).logprobs
        assert float((torch.tensor(s.columns["rollout_logprobs"])[:cut] - new_lp[:cut]).abs().max()) > 1e-2
    batch_versions = [[int(v) for v in s.columns["token_versions"]] for s in samples]
    batch = RolloutBatch(
        prompt_ids=[PROMPT] * 8, response_ids=[s.output_ids for s in samples],
        rewards=[0.0] * 8, correct=[False] * 8,
        truncated=[True] * 8, weight_versions=[s.weight_version for s in samples],
        columns={"rollout_logprobs": [s.columns["rollout_logprobs"] for s in samples],
                 "token_versions": batch_versions},
    )  # fmt: skip
    metrics = rollout_metrics(batch, policy_version=1)
    assert metrics["rollout/partial_fraction"] == 1.0
    assert metrics["rollout/versions_per_sample_mean"] == 2.0
    assert metrics["rollout/staleness_max"] == 1.0
    # begun by version 0: stale, though version 1 finished each (its reported weight_version); it read 0.0
    assert {s.weight_version for s in samples} == {"1"} and metrics["rollout/stale_fraction"] == 1.0


def test_a_sequence_joining_a_running_batch_gets_what_it_gets_alone(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, dtype="float32")
    try:
        first = item("a", [5, 6, 84], temperature=1.0, log_rho=LOG_RHO, seed=3, max_new_tokens=60)
        second = item(
            "b", [9, 10, 11, 12, 13, 14], temperature=0.7, log_rho=LOG_RHO, seed=4, max_new_tokens=8
        )
        alone = [engine.generate([first])[0], engine.generate([second])[0]]
        out: dict[str, dict] = {}
        _pause_at_tokens(engine, 10, "in_place")  # "b" then surely joins a running "a" (10 tokens in)
        thread = threading.Thread(target=lambda: out.update(a=engine.generate([first])[0]))
        thread.start()
        _hold(engine, None)
        joining = threading.Thread(target=lambda: out.update(b=engine.generate([second])[0]))
        joining.start()
        engine.control.resume()
        joining.join()
        thread.join()
    finally:
        engine.close()
    for got, want in zip((out["a"], out["b"]), alone, strict=True):
        assert got["output_ids"] == want["output_ids"]
        got_lp = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        want_lp = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
        assert got_lp == pytest.approx(want_lp, abs=1e-5)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_retract_recomputes_the_kv_cache_in_place_keeps_it(tiny_model_dir, perturbed_model_dir, mode):
    """SGLang's two non-abort pauses: after a weight update, `retract` continues with KV recomputed under the
    new weights (its later tokens' log-probs are the new model's on the whole sequence); `in_place` keeps the
    old weights' KV (they are not)."""
    new = _model(perturbed_model_dir)
    engine = LocalEngine(tiny_model_dir, dtype="float32")
    try:
        request = item("r", PROMPT, temperature=1.0, log_rho=LOG_RHO, seed=5, max_new_tokens=30)
        out: dict[str, dict] = {}
        _pause_at_tokens(engine, 8, mode)
        thread = threading.Thread(target=lambda: out.update(r=engine.generate([request])[0]))
        thread.start()
        _hold(engine, None)
        done_before = len(
            next(iter(engine.batcher.waiting if mode == "retract" else engine.batcher.running)).outputs
        )
        engine.update_weights_from_disk(str(perturbed_model_dir), weight_version="1")
        engine.control.resume()
        thread.join()
    finally:
        engine.close()
    ids = out["r"]["output_ids"]
    got = torch.tensor([lp for lp, _, _ in out["r"]["meta_info"]["output_token_logprobs"]])
    want = reference_logprobs(new, PROMPT, ids, log_rho=LOG_RHO, temperature=1.0).logprobs
    after = slice(done_before + 1, len(ids))  # the first token after resuming onwards
    error = float((got[after] - want[after]).abs().max())
    if mode == "retract":
        assert error < 1e-4
    else:
        assert error > 1e-3
    # each token's weights, as SGLang reports them (`meta_info.weight_versions`, utils/weight_versions.py)
    meta = out["r"]["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": done_before},
        {"version": "1", "start": done_before, "end": len(ids)},
    ]
    assert meta["weight_version"] == "1"
