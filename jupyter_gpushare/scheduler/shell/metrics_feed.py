"""Feeding the Prometheus metrics (:mod:`.metrics`) from the scheduler's loop.

The listener runs in its own thread; this module starts and stops it off the loop, counts each
hold's GPU time as it goes, and republishes the policy's snapshot every ``interval`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .transport import Connection, Log

__all__ = ["MetricsFeed"]


class MetricsFeed:
    """The scheduler's metrics: off until :meth:`start`; every method is safe when off."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.metrics: Any = None  # a .metrics.SchedulerMetrics while serving
        self._task: asyncio.Future[None] | None = None

    async def start(
        self,
        address: str,
        port: int,
        interval: float,
        snapshot: Callable[[float], tuple[list[dict[str, Any]], int]],
        shims: Callable[[], Iterable[Connection]],
        *,
        gpus: Iterable[Any] = (),
        utilization: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        """Serve on ``address:port`` (OSError if it cannot; port 0: no listener, the metrics are
        only kept, for the host process to serve) and refresh every ``interval`` s.
        ``snapshot(now)`` gives the policy's devices and the number of connections, ``gpus`` the
        GPUs NVML discovered (dcgm-exporter's labels), ``utilization()`` the NVML sampler's last
        reading."""
        from .metrics import SchedulerMetrics

        metrics = SchedulerMetrics()
        metrics.set_gpus(gpus)
        if port:
            await asyncio.get_running_loop().run_in_executor(None, metrics.serve, address, port)
            self.log.info("metrics on http://%s:%d/metrics", address, metrics.port)
        self.metrics = metrics
        self._snapshot, self._shims, self._utilization = snapshot, shims, utilization
        self.refresh()
        self._task = asyncio.ensure_future(self._loop(interval))

    async def _loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(max(interval, 0.01))
            self.refresh()

    def refresh(self, now: float | None = None) -> None:
        """Count the GPU time of current holds and publish a fresh snapshot (on the loop)."""
        if self.metrics is None:
            return
        now = time.monotonic() if now is None else now
        for conn in self._shims():
            self.account(conn, now)
        devices, connections = self._snapshot(now)
        self.metrics.publish(devices, connections, self._utilization(), now)

    def account(self, conn: Connection, now: float) -> None:
        """Add ``conn``'s GPU time since it was last counted to its user's total."""
        if self.metrics is None or conn.granted_at is None or conn.identity is None:
            return
        since = conn.accounted_at if conn.accounted_at is not None else conn.granted_at
        if now > since:
            self.metrics.gpu_time(conn.identity.user, now - since)
        conn.accounted_at = now

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.metrics is not None:
            metrics, self.metrics = self.metrics, None
            await asyncio.get_running_loop().run_in_executor(None, metrics.shutdown)
