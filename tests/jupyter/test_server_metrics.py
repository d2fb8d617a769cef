"""The embedded scheduler's Prometheus metrics on the Jupyter server's own /metrics (beside
jupyter_server's), while the scheduler runs, and gone when it stops."""

from __future__ import annotations

import asyncio
from typing import Any

from server_helpers import *  # noqa: F403
from server_helpers import DEVICE, FakeShim, MiB, extension, started


async def scrape(jp_fetch: Any) -> str:
    resp = await jp_fetch("metrics", method="GET")
    return str(resp.body.decode())


async def test_embedded_scheduler_metrics_on_the_servers_metrics(
    jp_fetch: Any, jp_serverapp: Any
) -> None:
    ext = await started(jp_serverapp)
    scheduler = ext.backend.scheduler
    assert scheduler is not None and scheduler.metrics is not None
    assert scheduler.metrics.port == 0, "no listener of its own: the server's /metrics serves it"
    shim = await FakeShim.join(ext.backend.socket_path, "k1", used=300 * MiB)
    try:
        await asyncio.sleep(max(scheduler.metrics_interval, 0.05) * 3)
        text = await scrape(jp_fetch)
        assert "gpushare_build_info{" in text
        assert f'gpushare_clients{{UUID="{DEVICE}",device="{DEVICE}"' in text
        assert "http_request_duration_seconds" in text  # jupyter_server's own are still there
    finally:
        await shim.close()
    await ext.backend.stop()
    assert "gpushare_" not in await scrape(jp_fetch)


async def test_stopping_leaves_no_collector_behind(jp_fetch: Any, jp_serverapp: Any) -> None:
    """Stopping is idempotent, and a stopped backend leaves nothing registered behind."""
    ext = await started(jp_serverapp)
    await ext.backend.stop()
    await ext.backend.stop()
    assert extension(jp_serverapp).backend.scheduler is None
    assert "gpushare_" not in await scrape(jp_fetch)
