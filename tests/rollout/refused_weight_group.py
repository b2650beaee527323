"""A trainer whose weight group the engine refuses (`/init_weights_update_group` answers success: false)
while the group's rendezvous waits for it under a one-hour timeout: prints the error, then exits
(`test_weight_sync.py` times how long the exit takes to come)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from megatron_tail.rollout import DistributedWeightSync, WeightSyncError
from megatron_tail.utils.net import reserve_port
from tests.rollout.servers import serving_app


async def refuse(_request):
    return web.json_response({"success": False, "message": "Failed to init the group (as a test)"})


async def main() -> None:
    app = web.Application()
    app.router.add_post("/init_weights_update_group", refuse)
    async with serving_app(app) as url:
        sync = DistributedWeightSync(
            [url],
            master_address="127.0.0.1",
            listen_socket=reserve_port(""),
            engine_tp_sizes=[1],
            backend="gloo",
            timeout_s=3600.0,
        )
        try:
            await sync.init_group()
        except WeightSyncError as e:
            print(f"refused: {e}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
