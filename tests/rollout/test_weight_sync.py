"""Weight updates into running local engines: outputs change, `weight_version` is bumped and recorded,
and the disk and the distributed (gloo) paths load the same weights."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from megatron_tail.rollout import (
    ClientConfig,
    DiskWeightSync,
    DistributedWeightSync,
    RolloutClient,
    SamplingConfig,
    StaleWeightsError,
)
from megatron_tail.rollout.local_engine.weights import read_safetensors_dir
from megatron_tail.utils.net import free_port

PROMPTS = [[5, 6, 76, 7, 84], [8, 9, 76, 10, 11, 84], [12, 76, 13, 84]]
SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=10, temperature=1.0, log_rho=-4.0, base_seed=11)


async def sample(url, sampling=SAMPLING, version=None):
    async with RolloutClient([url], ClientConfig(request_timeout_s=60)) as client:
        groups = await client.generate(PROMPTS, sampling, require_weight_version=version)
    return [r for group in groups for r in group]


def outputs(results):
    return [(r.output_ids, r.output_logprobs) for r in results]


async def model_info_version(url):
    async with aiohttp.ClientSession() as session, session.get(f"{url}/model_info") as resp:
        return (await resp.json())["weight_version"]


def test_disk_and_distributed_updates_change_outputs_and_bump_weight_version(
    server_pair, tiny_model_dir, perturbed_model_dir
):
    a, b = (s.url for s in server_pair)

    async def scenario():
        before_a, before_b = await sample(a), await sample(b)
        assert outputs(before_a) == outputs(before_b), "same weights and seeds must give the same samples"

        disk = DiskWeightSync([b])
        assert await disk.update(str(perturbed_model_dir)) == "1" == disk.weight_version
        nccl_like = DistributedWeightSync(
            [a], master_address="127.0.0.1", master_port=free_port(), backend="gloo", initial_version="10"
        )
        await nccl_like.init_group()
        tensors = read_safetensors_dir(perturbed_model_dir)
        assert await nccl_like.update(sorted(tensors.items())) == "11"
        after_a, after_b = await sample(a, version="11"), await sample(b, version="1")
        versions = (await model_info_version(a), await model_info_version(b))
        with pytest.raises(
            StaleWeightsError, match=r"other than '11': \(server, version\) \[\('http.*', '1'\)\]"
        ):
            await sample(b, version="11")

        await DiskWeightSync([a, b], initial_version="11").update(str(tiny_model_dir))
        restored = await sample(a)
        await nccl_like.destroy_group()
        return before_a, after_a, after_b, versions, restored

    before, after_a, after_b, versions, restored = asyncio.run(scenario())

    assert versions == ("11", "1")
    assert {r.weight_version for r in after_a} == {"11"} and {r.weight_version for r in after_b} == {"1"}
    assert outputs(after_a) == outputs(after_b), (
        "the broadcast path must load exactly what the disk path loads"
    )
    for old, new in zip(before, after_a, strict=True):
        assert old.output_logprobs[0] != new.output_logprobs[0], (
            "new weights change the first-step distribution"
        )
    assert outputs(restored) == outputs(before) and {r.weight_version for r in restored} == {"12"}


def test_update_during_generation_aborts_and_client_retries_on_new_weights(server_pair, tiny_model_dir):
    urls = [s.url for s in server_pair]
    long_sampling = SamplingConfig(n_samples=2, max_new_tokens=80, ignore_eos=True, log_rho=-4.0, base_seed=5)

    async def scenario():
        sync = DiskWeightSync(urls, initial_version="100")
        async with RolloutClient(urls, ClientConfig(request_timeout_s=120, retry_backoff_s=0.05)) as client:
            task = asyncio.create_task(client.generate(PROMPTS[:2] * 2, long_sampling))
            while not all(client.in_flight[u] for u in urls):
                await asyncio.sleep(0.005)
            version = await sync.update(str(tiny_model_dir))
            groups = await task
        return version, groups, client.stats

    version, groups, stats = asyncio.run(scenario())
    flat = [r for group in groups for r in group]
    assert len(flat) == 8 and len({r.key for r in flat}) == 8
    assert version == "101" and {r.weight_version for r in flat} == {"101"}
    assert stats.retries >= 1
    assert all(len(r.output_ids) == 80 and r.finish_reason == {"type": "length", "length": 80} for r in flat)
