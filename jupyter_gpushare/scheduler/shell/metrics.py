"""Prometheus metrics of the node scheduler (``GPUShareScheduler.metrics_port``).

Two kinds of values, both produced on the scheduler's event loop and read by prometheus_client's
HTTP thread:

* counters and the wait histogram are updated as the scheduler carries out the policy's
  decisions and reads the shims' answers (prometheus_client's metric objects are thread-safe);
* gauges (holders, queues, clients, memory) come from the policy's snapshot, which the loop takes
  every ``metrics_interval`` seconds and publishes as one immutable object; a scrape reads the
  last one, so it never touches the policy and never blocks the loop.

The metrics (all prefixed ``gpushare_``) are listed in docs/operators/node-scheduler.md.

Every per-device metric carries ``device`` (the GPU's UUID, as before) and dcgm-exporter's own
labels for the same GPU: ``UUID`` (the same UUID), ``gpu`` (NVML's index) and ``modelName``, so a
query joins ours with DCGM's by ``on(UUID)``. A device learnt from a shim rather than from NVML
has ``gpu`` and ``modelName`` empty.

Deprecated names, still exported for one release (CHANGELOG.md): ``gpushare_bytes_moved_total``
(now ``gpushare_moved_bytes_total``), ``gpushare_holder`` (``gpushare_user_holding_clients``) and
the 0/1 ``gpushare_turns_mode`` (the enum-style ``gpushare_device_mode{mode=...}``).
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from ..._version import __version__
from ...protocol import printable

# No `<counter>_created` series: nothing reads them and they doubled each counter's series. The
# switch is prometheus_client's, for the whole process (a Jupyter server's own metrics too).
disable_created_metrics()

__all__ = ["DEVICE_LABELS", "DEVICE_MODES", "DelegatingCollector", "SchedulerMetrics"]

#: The labels of every per-device metric: ours, then dcgm-exporter's names for the same GPU.
DEVICE_LABELS = ("device", "UUID", "gpu", "modelName")
#: The values of gpushare_device_mode's ``mode`` label (the policy's snapshot "mode").
DEVICE_MODES = ("shared", "turns")

#: Waits range from a free device (milliseconds) to several turns of a minute.
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class _Snapshot:
    devices: tuple[dict[str, Any], ...] = ()
    connections: int = 0
    #: device uuid -> percent of time a kernel ran (the NVML sampler's last reading)
    utilization: Mapping[str, int] = field(default_factory=dict)
    #: the scheduler's monotonic clock when the snapshot was taken (waits are measured to it)
    taken_at: float = 0.0


class _SnapshotCollector(Collector):
    """Gauges from the last published snapshot (users and clients that left simply vanish)."""

    def __init__(self, device_labels: Any) -> None:
        self.snapshot = _Snapshot()
        self._device_labels = device_labels  # uuid -> [device, UUID, gpu, modelName]
        self.host_budget = 0  # the node's host budget (bytes; 0: not accounted)

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot  # one read: the loop replaces the object, never mutates it
        build = InfoMetricFamily(
            "gpushare_build", "The scheduler's release and the Python that runs it."
        )
        build.add_metric([], {"version": __version__, "python": platform.python_version()})
        yield build
        conns = GaugeMetricFamily(
            "gpushare_connections", "Open connections to the scheduler (shims and control)."
        )
        conns.add_metric([], snap.connections)
        yield conns
        dev_labels = list(DEVICE_LABELS)
        user_labels = [*DEVICE_LABELS, "user"]
        clients = GaugeMetricFamily(
            "gpushare_clients", "Shim clients per device.", labels=dev_labels
        )
        holders = GaugeMetricFamily(
            "gpushare_holders",
            "Clients holding the device (running or revoking).",
            labels=dev_labels,
        )
        holding = GaugeMetricFamily(
            "gpushare_user_holding_clients",
            "Clients of each user that hold the device (a user who holds nothing is absent).",
            labels=user_labels,
        )
        holder = GaugeMetricFamily(
            "gpushare_holder",
            "DEPRECATED: use gpushare_user_holding_clients (removed in the next release).",
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
        mode = GaugeMetricFamily(
            "gpushare_device_mode",
            "The device's mode: 1 on the current one (shared: side by side; turns: exclusive).",
            labels=[*DEVICE_LABELS, "mode"],
        )
        turns = GaugeMetricFamily(
            "gpushare_turns_mode",
            'DEPRECATED: use gpushare_device_mode{mode="turns"} (removed in the next release).',
            labels=dev_labels,
        )
        longest_wait = GaugeMetricFamily(
            "gpushare_longest_wait_seconds",
            "How long the longest-waiting client has waited for the device so far (0: none waits).",
            labels=dev_labels,
        )
        longest_revoke = GaugeMetricFamily(
            "gpushare_longest_revoke_seconds",
            "How long the oldest unanswered REVOKE has been out (0: none is).",
            labels=dev_labels,
        )
        utilization = GaugeMetricFamily(
            "gpushare_gpu_utilization_ratio",
            "Fraction of NVML's last sample period in which a kernel ran on the GPU (0-1); "
            "absent without NVML.",
            labels=dev_labels,
        )
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
            labels = self._device_labels(uuid)
            cls = dev.get("clients", [])
            clients.add_metric(labels, len(cls))
            holders.add_metric(labels, len(dev.get("holders", [])))
            queue.add_metric(labels, len(dev.get("queue", [])))
            pool.add_metric(labels, int(dev.get("pool_bytes") or 0))
            resident.add_metric(labels, int(dev.get("resident_bytes") or 0))
            for name in DEVICE_MODES:
                mode.add_metric([*labels, name], 1 if dev.get("mode") == name else 0)
            turns.add_metric(labels, 1 if dev.get("mode") == "turns" else 0)
            waits = [
                snap.taken_at - c["waiting_since"]
                for c in cls
                if c.get("waiting_since") is not None
            ]
            longest_wait.add_metric(labels, max([0.0, *waits]))
            revokes = [c.get("revoking_seconds") or 0.0 for c in cls]
            longest_revoke.add_metric(labels, max([0.0, *revokes]))
            if uuid in snap.utilization:
                utilization.add_metric(labels, snap.utilization[uuid] / 100.0)
            per_user: dict[str, list[int]] = {}  # user -> [clients, used, resident, holding]
            for c in cls:
                row = per_user.setdefault(printable(str(c.get("user", ""))), [0, 0, 0, 0])
                used = int(c.get("used_bytes") or 0)
                row[0] += 1
                row[1] += used
                row[2] += max(used - int(c.get("evicted_bytes") or 0), 0)
                row[3] += int(c.get("state") in ("running", "revoking"))
            for user, (n, used, res, held) in sorted(per_user.items()):
                user_clients.add_metric([*labels, user], n)
                user_used.add_metric([*labels, user], used)
                user_resident.add_metric([*labels, user], res)
                if held:
                    holding.add_metric([*labels, user], held)
                    holder.add_metric([*labels, user], held)
        yield from (clients, holders, holding, holder, queue, pool, resident, mode, turns)
        yield from (longest_wait, longest_revoke, utilization)
        yield from (user_clients, user_used, user_resident)
        yield from self._host(snap)

    def _host(self, snap: _Snapshot) -> Iterator[Metric]:
        """The node's host memory (docs/architecture.md, "Host memory is a budget")."""
        budget = GaugeMetricFamily(
            "gpushare_host_budget_bytes",
            "Host memory the shims' staging and evicted memory may take on this node (0: not "
            "accounted).",
        )
        budget.add_metric([], self.host_budget)
        held = GaugeMetricFamily(
            "gpushare_host_held_bytes",
            "Host memory the shims' memory engines hold on this node (staging, evicted memory).",
        )
        total = sum(int(c.get("host_bytes") or 0) for d in snap.devices for c in d["clients"])
        held.add_metric([], total)
        yield from (budget, held)


class DelegatingCollector(Collector):
    """Yields what another registry collects: the embedded scheduler's metrics on the Jupyter
    server's own /metrics (prometheus_client's global REGISTRY), beside jupyter_server's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        return self._registry.collect()

    def describe(self) -> Iterable[Metric]:
        return ()  # unchecked names: the scheduler may come and go while the server runs


class SchedulerMetrics:
    """The scheduler's metrics in their own registry, served over HTTP by :meth:`serve`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: uuid (lower case) -> (NVML index, model name), from :meth:`set_gpus`
        self._gpus: dict[str, tuple[str, str]] = {}
        self._gauges = _SnapshotCollector(self.device_labels)
        self.registry.register(self._gauges)
        dev = list(DEVICE_LABELS)
        self.grants = Counter(
            "gpushare_grants", "Grants of a device to a client.", dev, registry=self.registry
        )
        self.handoffs = Counter(
            "gpushare_handoffs",
            "Turns handed over: a holder answered the scheduler's REVOKE with RELEASED.",
            dev,
            registry=self.registry,
        )
        self.moved_bytes = Counter(
            "gpushare_moved_bytes",
            "Bytes the shims moved between device and host (evict: to the host; restore: back).",
            [*dev, "direction"],
            registry=self.registry,
        )
        self.bytes_moved = Counter(
            "gpushare_bytes_moved",
            "DEPRECATED: use gpushare_moved_bytes_total (removed in the next release).",
            [*dev, "direction"],
            registry=self.registry,
        )
        self.waits = Histogram(
            "gpushare_wait_seconds",
            "How long a client waited for the device, from its REQUEST to its GRANT.",
            dev,
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

    def set_gpus(self, gpus: Iterable[Any]) -> None:
        """The GPUs NVML discovered (objects with ``uuid``, ``index``, ``name``), for the labels
        that join with dcgm-exporter. Call before the first grant, or a device's counters start
        a second series when its index and model become known."""
        self._gpus = {str(g.uuid).lower(): (str(g.index), str(g.name)) for g in gpus}

    def set_host_budget(self, budget: int) -> None:
        """The node's host budget (bytes; 0: not accounted), for gpushare_host_budget_bytes."""
        self._gauges.host_budget = budget

    def device_labels(self, uuid: str) -> list[str]:
        index, model = self._gpus.get(uuid.lower(), ("", ""))
        uuid = printable(uuid)  # learnt from a HELLO without NVML: a peer's text
        return [uuid, uuid, index, printable(model)]

    def granted(self, device: str, waited: float | None) -> None:
        labels = self.device_labels(device)
        self.grants.labels(*labels).inc()
        if waited is not None:
            self.waits.labels(*labels).observe(max(waited, 0.0))

    def released(self, device: str, after_revoke: bool, evicted_bytes: int) -> None:
        if after_revoke:
            self.handoffs.labels(*self.device_labels(device)).inc()
        self.moved(device, "evict", evicted_bytes)

    def moved(self, device: str, direction: str, nbytes: int) -> None:
        if nbytes > 0:
            labels = self.device_labels(device)
            self.moved_bytes.labels(*labels, direction).inc(nbytes)
            self.bytes_moved.labels(*labels, direction).inc(nbytes)

    def gpu_time(self, user: str, seconds: float) -> None:
        if seconds > 0:
            self.user_gpu.labels(printable(user)).inc(seconds)

    def publish(
        self,
        devices: list[dict[str, Any]],
        connections: int,
        utilization: Mapping[str, int] | None = None,
        now: float | None = None,
    ) -> None:
        """The policy's snapshot taken at ``now`` (time.monotonic(), the scheduler's clock;
        default: the time of this call) and the NVML sampler's last reading (uuid -> percent)."""
        taken_at = time.monotonic() if now is None else now
        self._gauges.snapshot = _Snapshot(
            tuple(devices), connections, dict(utilization or {}), taken_at
        )

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
