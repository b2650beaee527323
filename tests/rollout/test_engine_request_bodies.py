"""The local engine's weight and control endpoints refuse a body that is not a JSON object by naming the
object they take (before: `/pause_generation` with an array answered "'list' object has no attribute
'get'", and `/destroy_weights_update_group` answered HTTP 500)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.rollout.servers import serving_app


def test_a_body_that_is_not_a_json_object_is_refused_naming_the_expected_object(tiny_model_dir):
    from megatron_tail.rollout.local_engine.engine import LocalEngine
    from megatron_tail.rollout.local_engine.server import build_app

    async def scenario():
        answers = {}
        async with serving_app(build_app(LocalEngine(tiny_model_dir))) as url, aiohttp.ClientSession() as s:
            for path in ("/pause_generation", "/update_weight_version", "/destroy_weights_update_group"):
                async with s.post(f"{url}{path}", json=["abort"]) as resp:
                    answers[path] = (resp.status, await resp.json(content_type=None))
        return answers

    answers = asyncio.run(scenario())
    assert answers["/pause_generation"] == (
        400,
        {
            "error": {
                "message": '/pause_generation body must be a JSON object {"mode": "abort" | "retract" | '
                '"in_place"}; got a JSON array'
            }
        },
    )
    assert answers["/update_weight_version"] == (
        400,
        {
            "success": False,
            "message": "Failed to update weight version: /update_weight_version body must be a JSON object "
            '{"new_version": str}; got a JSON array',
        },
    )
    assert answers["/destroy_weights_update_group"] == (
        400,
        {
            "success": False,
            "message": '/destroy_weights_update_group body must be a JSON object {"group_name": str}; got a '
            "JSON array",
        },
    )
