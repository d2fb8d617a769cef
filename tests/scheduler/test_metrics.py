"""The scheduler's Prometheus metrics as Prometheus sees them: names and types by the exposition
parser, Prometheus' naming rules, the labels that join with dcgm-exporter, the deprecated names
beside the new ones, and the gauges the alerts watch (longest wait, unanswered revoke)."""

from __future__ import annotations

import asyncio
import platform
import re
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sched_helpers import DEVICE, MiB
from test_daemon import free_port
from test_utilization import UUID as NVML_UUID
from test_utilization import FakeNVML, nvml  # noqa: F401 (nvml: the fixture)

from jupyter_gpushare._version import __version__
from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.scheduler.shell.metrics import DelegatingCollector, SchedulerMetrics

#: What our names end in: a base unit (https://prometheus.io/docs/practices/naming/) or, for a
#: count, the noun counted.
UNITS = ("bytes", "seconds", "ratio", "info", "mode", "clients", "holders", "connections", "length",
         "grants", "handoffs")  # fmt: skip
DEPRECATED = {"gpushare_bytes_moved", "gpushare_holder", "gpushare_turns_mode"}


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def sample(fams: dict[str, Any], family: str, name: str | None = None, **labels: str) -> float:
    """The value of the one sample of ``family`` whose labels include ``labels``."""
    found = [
        s.value
        for s in fams[family].samples
        if (name is None or s.name == name) and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (family, labels, fams[family].samples)
    return float(found[0])


async def test_scraped_names_types_and_alert_gauges(make_scheduler: Any, connect: Any) -> None:
    server = await make_scheduler(metrics_port=free_port(), metrics_interval=0.05)
    a, b = await connect(), await connect()
    await a.hello("a", user="alice")
    await b.hello("b", user="bob")
    await a.request(800 * MiB)
    await a.expect(MsgType.GRANT)
    await a.send(MsgType.IDLE, idle_ms=100)
    await b.request(800 * MiB)  # does not fit: alice's idle turn is revoked, and she sits on it
    await a.expect(MsgType.REVOKE)
    await asyncio.sleep(0.4)
    fams = families(await asyncio.to_thread(fetch, server.metrics.port))

    # Prometheus' rules: a prefix, a unit or a count noun at the end, counters as *_total.
    for name, fam in fams.items():
        assert name.startswith("gpushare_"), name
        if name.endswith("_created") and name.removesuffix("_created") in fams:
            continue  # prometheus_client's creation timestamp of a counter or histogram
        if name in DEPRECATED:
            assert fam.documentation.startswith("DEPRECATED: use "), name
            continue
        assert name.rsplit("_", 1)[-1] in UNITS or fam.type == "histogram", name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
    assert fams["gpushare_moved_bytes"].type == "counter"
    assert fams["gpushare_device_mode"].type == "gauge"
    assert fams["gpushare_build_info"].type == "gauge"  # an info metric, in the text format

    build = sample(
        fams, "gpushare_build_info", version=__version__, python=platform.python_version()
    )
    assert build == 1
    dev = {"device": DEVICE, "UUID": DEVICE}
    assert sample(fams, "gpushare_device_mode", mode="turns", **dev) == 1
    assert sample(fams, "gpushare_device_mode", mode="shared", **dev) == 0
    assert sample(fams, "gpushare_turns_mode", **dev) == 1  # the deprecated 0/1 agrees
    holding = sample(fams, "gpushare_user_holding_clients", **dev)  # alice (uid's name)
    assert holding == sample(fams, "gpushare_holder", **dev) == 1
    # bob waits and alice has not answered her REVOKE: both are measured, both keep growing.
    wait = sample(fams, "gpushare_longest_wait_seconds", **dev)
    revoke = sample(fams, "gpushare_longest_revoke_seconds", **dev)
    assert 0.2 < wait < 10 and 0.2 < revoke < 10
    await asyncio.sleep(0.3)
    later = families(await asyncio.to_thread(fetch, server.metrics.port))
    assert sample(later, "gpushare_longest_wait_seconds", **dev) > wait
    assert sample(later, "gpushare_longest_revoke_seconds", **dev) > revoke
    # Without NVML there is no utilisation reading: the gauge is absent, not a made-up 0.
    assert not fams["gpushare_gpu_utilization_ratio"].samples

    await a.send(MsgType.RELEASED, flag=1, evicted_bytes=800 * MiB, bytes_moved=800 * MiB,
                 micros=80_000)  # fmt: skip
    await b.expect(MsgType.GRANT)
    await asyncio.sleep(0.3)
    fams = families(await asyncio.to_thread(fetch, server.metrics.port))
    assert sample(fams, "gpushare_longest_wait_seconds", **dev) == 0
    assert sample(fams, "gpushare_longest_revoke_seconds", **dev) == 0
    new = sample(fams, "gpushare_moved_bytes", "gpushare_moved_bytes_total", direction="evict")
    old = sample(fams, "gpushare_bytes_moved", "gpushare_bytes_moved_total", direction="evict")
    assert new == old == 800 * MiB


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str


def test_device_labels_join_with_dcgm_exporter() -> None:
    """dcgm-exporter labels a GPU's series UUID="GPU-…", gpu="<index>", modelName="<name>"
    (its docs' example: DCGM_FI_DEV_SM_CLOCK{gpu="0", UUID="GPU-604a…"}); ours carry the same,
    so `on(UUID)` joins them. Counters and gauges get them alike."""
    uuid = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
    metrics = SchedulerMetrics()
    metrics.set_gpus([Gpu(3, uuid.upper(), "NVIDIA H100 80GB HBM3")])  # NVML's case may differ
    snap = {"uuid": uuid, "mode": "shared", "clients": [], "holders": [], "queue": [],
            "pool_bytes": 1 << 30, "resident_bytes": 0}  # fmt: skip
    metrics.publish([snap], 0, utilization={uuid: 37})
    metrics.granted(uuid, 0.5)
    fams = families(generate_latest(metrics.registry).decode())
    want = {"UUID": uuid, "gpu": "3", "modelName": "NVIDIA H100 80GB HBM3", "device": uuid}
    assert sample(fams, "gpushare_gpu_utilization_ratio", **want) == 0.37
    assert sample(fams, "gpushare_grants", "gpushare_grants_total", **want) == 1
    assert sample(fams, "gpushare_pool_bytes", **want) == 1 << 30
    for fam in fams.values():
        for s in fam.samples:
            if "device" in s.labels:
                assert s.labels.keys() >= want.keys(), (fam.name, s.labels)


def test_the_embedded_schedulers_metrics_join_another_registry() -> None:
    """What the Jupyter server's /metrics serves: its registry plus ours, through a collector."""
    metrics = SchedulerMetrics()
    host = CollectorRegistry()
    collector = DelegatingCollector(metrics.registry)
    host.register(collector)
    text = generate_latest(host).decode()
    assert re.search(rf'^gpushare_build_info{{.*version="{re.escape(__version__)}"', text, re.M)
    host.unregister(collector)
    assert "gpushare_" not in generate_latest(host).decode()


async def test_nvml_gives_dcgm_labels_and_utilisation(
    make_scheduler: Any, request: pytest.FixtureRequest, connect: Any
) -> None:
    """With NVML, the scheduler's series carry the GPU's index and model as dcgm-exporter does,
    and the utilisation gauge follows the sampler's readings."""
    fake: FakeNVML = request.getfixturevalue("nvml")  # test_utilization's stand-in pynvml
    server = await make_scheduler(use_nvml=True, metrics_port=free_port(), metrics_interval=0.05,
                                  utilization_interval=0.05)  # fmt: skip
    shim = await connect()
    await shim.hello("a", device=NVML_UUID)
    await shim.request(100 * MiB)
    await shim.expect(MsgType.GRANT)
    want = {"UUID": NVML_UUID, "device": NVML_UUID, "gpu": "0", "modelName": "Test GPU"}

    async def ratio() -> float:
        fams = families(await asyncio.to_thread(fetch, server.metrics.port))
        assert sample(fams, "gpushare_grants", "gpushare_grants_total", **want) == 1
        return sample(fams, "gpushare_gpu_utilization_ratio", **want)

    await asyncio.sleep(0.3)
    assert await ratio() == fake.percent / 100
    fake.percent = 80
    await asyncio.sleep(0.3)
    assert await ratio() == 0.8
