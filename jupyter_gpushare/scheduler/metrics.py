"""Prometheus metrics of the node scheduler (``GPUShareScheduler.metrics_port``).

Two kinds of values, both produced on the scheduler's event loop and read by prometheus_client's
HTTP thread:

* counters and the wait histogram are updated as the scheduler carries out the policy's
  decisions and reads the shims' answers (prometheus_client's metric objects are thread-safe);
* gauges (holders, queues, clients, memory) come from the policy's snapshot, which the loop takes
  every ``metrics_interval`` seconds and publishes as one immutable object; a scrape reads the
  last one, so it never touches the policy and never blocks the loop.

The metrics (all prefixed ``gpushare_``) are listed in docs/operators/node-scheduler.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["SchedulerMetrics"]

#: Waits range from a free device (milliseconds) to several turns of a minute.
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class _Snapshot:
    devices: tuple[dict[str, Any], ...] = ()
    connections: int = 0


class _SnapshotCollector(Collector):
    """Gauges from the last published snapshot (users and clients that left simply vanish)."""

    def __init__(self) -> None:
        self.snapshot = _Snapshot()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot  # one read: the loop replaces the object, never mutates it
        conns = GaugeMetricFamily(
            "gpushare_connections", "Open connections to the scheduler (shims and control)."
        )
        conns.add_metric([], snap.connections)
        yield conns
        dev_labels = ["device"]
        user_labels = ["device", "user"]
        clients = GaugeMetricFamily(
            "gpushare_clients", "Shim clients per device.", labels=dev_labels
        )
        holders = GaugeMetricFamily(
            "gpushare_holders",
            "Clients holding the device (running or revoking).",
            labels=dev_labels,
        )
        holder = GaugeMetricFamily(
            "gpushare_holder",
            "Clients of each user that hold the device (a user who holds nothing is absent).",
            labels=user_labels,
        )
        queue = GaugeMetricFamily(
            "gpushare_queue_length", "Clients waiting for the device.", labels=dev_labels
        )
        pool = GaugeMetricFamily(
            "gpushare_pool_bytes", "The device's memory pool.", labels=dev_labels
        )
        resident = GaugeMetricFamily(
            "gpushare_resident_bytes", "Memory the clients occupy on the device.", labels=dev_labels
        )
        turns = GaugeMetricFamily(
            "gpushare_turns_mode", "1 when clients take exclusive turns, 0 when they share.",
            labels=dev_labels,
        )  # fmt: skip
        user_clients = GaugeMetricFamily(
            "gpushare_user_clients", "Clients of each user.", labels=user_labels
        )
        user_used = GaugeMetricFamily(
            "gpushare_user_memory_bytes",
            "Device memory the user's clients hold (resident or evicted to the host).",
            labels=user_labels,
        )
        user_resident = GaugeMetricFamily(
            "gpushare_user_resident_bytes",
            "Device memory of the user's clients that is on the device now.",
            labels=user_labels,
        )
        for dev in snap.devices:
            uuid = str(dev.get("uuid", ""))
            cls = dev.get("clients", [])
            clients.add_metric([uuid], len(cls))
            holders.add_metric([uuid], len(dev.get("holders", [])))
            queue.add_metric([uuid], len(dev.get("queue", [])))
            pool.add_metric([uuid], int(dev.get("pool_bytes") or 0))
            resident.add_metric([uuid], int(dev.get("resident_bytes") or 0))
            turns.add_metric([uuid], 1 if dev.get("mode") == "turns" else 0)
            per_user: dict[str, list[int]] = {}  # user -> [clients, used, resident, holding]
            for c in cls:
                row = per_user.setdefault(str(c.get("user", "")), [0, 0, 0, 0])
                used = int(c.get("used_bytes") or 0)
                row[0] += 1
                row[1] += used
                row[2] += max(used - int(c.get("evicted_bytes") or 0), 0)
                row[3] += int(c.get("state") in ("running", "revoking"))
            for user, (n, used, res, held) in sorted(per_user.items()):
                user_clients.add_metric([uuid, user], n)
                user_used.add_metric([uuid, user], used)
                user_resident.add_metric([uuid, user], res)
                if held:
                    holder.add_metric([uuid, user], held)
        yield from (clients, holders, holder, queue, pool, resident, turns)
        yield from (user_clients, user_used, user_resident)


class SchedulerMetrics:
    """The scheduler's metrics in their own registry, served over HTTP by :meth:`serve`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauges = _SnapshotCollector()
        self.registry.register(self._gauges)
        self.grants = Counter(
            "gpushare_grants", "Grants of a device to a client.", ["device"],
            registry=self.registry,
        )  # fmt: skip
        self.handoffs = Counter(
            "gpushare_handoffs",
            "Turns handed over: a holder answered the scheduler's REVOKE with RELEASED.",
            ["device"],
            registry=self.registry,
        )
        self.bytes_moved = Counter(
            "gpushare_bytes_moved",
            "Bytes the shims moved between device and host (evict: to the host; restore: back).",
            ["device", "direction"],
            registry=self.registry,
        )
        self.waits = Histogram(
            "gpushare_wait_seconds",
            "How long a client waited for the device, from its REQUEST to its GRANT.",
            ["device"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.user_gpu = Counter(
            "gpushare_user_gpu_seconds",
            "Seconds the user's clients held a device (summed over clients and devices).",
            ["user"],
            registry=self.registry,
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- from the event loop ------------------------------------------------------------------

    def granted(self, device: str, waited: float | None) -> None:
        self.grants.labels(device).inc()
        if waited is not None:
            self.waits.labels(device).observe(max(waited, 0.0))

    def released(self, device: str, after_revoke: bool, evicted_bytes: int) -> None:
        if after_revoke:
            self.handoffs.labels(device).inc()
        if evicted_bytes > 0:
            self.bytes_moved.labels(device, "evict").inc(evicted_bytes)

    def moved(self, device: str, direction: str, nbytes: int) -> None:
        if nbytes > 0:
            self.bytes_moved.labels(device, direction).inc(nbytes)

    def gpu_time(self, user: str, seconds: float) -> None:
        if seconds > 0:
            self.user_gpu.labels(user).inc(seconds)

    def publish(self, devices: list[dict[str, Any]], connections: int) -> None:
        self._gauges.snapshot = _Snapshot(tuple(devices), connections)

    # -- HTTP (blocking; the scheduler calls these in an executor) ----------------------------

    def serve(self, address: str, port: int) -> None:
        """Listen on ``address:port`` (0: any free port, then :attr:`port`) in a thread."""
        self._server, self._thread = start_http_server(port, address, registry=self.registry)
        self.port = int(self._server.server_port)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
