"""The device plugin against the kubelet stand-in and a real node scheduler: a pod's units come
from one GPU (a split is refused, with a Node event); a scheduler without NVML makes the plugin say
why it advertises nothing (log and event); NVML's critical XID errors turn a GPU's units Unhealthy
as NVIDIA's plugin judges them (a stand-in pynvml feeds the events). Events go to a stand-in
Kubernetes API server that keeps what it is sent."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from jupyter_gpushare.deviceplugin.plugin import DevicePluginServer, preferred_units
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2 as api
from tests.deviceplugin.kubelet_standin import KubeletStandIn, next_list, plugin_for

GiB = 1 << 30


class _APIHandler(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts.append((self.path, self.headers.get("Authorization"), body))
        reply = json.dumps({**body, "metadata": {"name": "e1"}}).encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture
def kube_api(tmp_path: Path) -> Iterator[Any]:
    """A stand-in API server (events only) and a service account directory for it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _APIHandler)
    server.posts = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("token-1\n")
    (account / "namespace").write_text("jhub\n")
    server.account = account  # type: ignore[attr-defined]
    server.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield server
    server.shutdown()


class FakeNVML:
    """pynvml's event API over a queue of (uuid or None, xid) the test fills."""

    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 8

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, uuids: list[str]) -> None:
        self.uuids = uuids
        self.events: queue.Queue[tuple[str | None, int]] = queue.Queue()
        self.registered: list[str] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return self.uuids[i]

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return handle.encode()

    def nvmlDeviceRegisterEvents(self, handle: str, kinds: int, event_set: object) -> None:
        assert kinds == self.nvmlEventTypeXidCriticalError
        self.registered.append(handle)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        try:
            uuid, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(device=uuid, eventType=self.nvmlEventTypeXidCriticalError,
                               eventData=xid)  # fmt: skip


def make_plugin(kubelet: KubeletStandIn, harness: Any, kube_api: Any) -> DevicePluginServer:
    return plugin_for(
        kubelet,
        harness,
        device_nodes=False,
        node_name="gpu-node-1",
        kube_api=kube_api.url,
        service_account_dir=str(kube_api.account),
    )


async def _until(predicate: Any, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_units_of_one_pod_come_from_one_gpu_and_xids_mark_gpus(
    kubelet: KubeletStandIn, harness: Any, kube_api: Any
) -> None:
    sched = harness.scheduler(pool="8GiB", fake_devices=2)
    status = await asyncio.to_thread(sched.status)
    uuid0, uuid1 = (d["uuid"] for d in status["devices"])
    plugin = make_plugin(kubelet, harness, kube_api)
    nvml = FakeNVML([uuid0, uuid1])
    plugin.xids.nvml = nvml
    await plugin.start()
    try:
        assert plugin.xid_health is None and nvml.registered == [uuid0, uuid1]
        request = await asyncio.wait_for(kubelet.requests.get(), 10)
        channel, stub = kubelet.plugin(request)
        async with channel:
            stream = stub.ListAndWatch(api.Empty())
            devices = await next_list(stream)
            assert len(devices) == 16 and {d.health for d in devices} == {"Healthy"}
            # 4 free on each GPU, a pod of 8: the kubelet can only split. The plugin prefers
            # what it can, and Allocate refuses the split with a message the pod's event carries.
            free = [f"{uuid0}-{n}" for n in range(4)] + [f"{uuid1}-{n}" for n in range(4)]
            assert len(preferred_units(free, [], 8, plugin.units)) == 8
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Allocate(
                    api.AllocateRequest(
                        container_requests=[api.ContainerAllocateRequest(devices_ids=free)]
                    )
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "split over 2 GPUs" in err.value.details()
            assert f"4 on {uuid0}" in err.value.details()
            [(path, auth, event)] = kube_api.posts
            assert path == "/api/v1/namespaces/jhub/events" and auth == "Bearer token-1"
            assert event["reason"] == "GPUShareUnitsSplit" and event["type"] == "Warning"
            node = {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1", "uid": "gpu-node-1"}
            assert event["involvedObject"] == node
            assert "split over 2 GPUs" in event["message"]
            # 8 units of one GPU are allocated as before.
            one = [f"{uuid1}-{n}" for n in range(8)]
            alloc = await stub.Allocate(
                api.AllocateRequest(
                    container_requests=[api.ContainerAllocateRequest(devices_ids=one)]
                )
            )
            assert dict(alloc.container_responses[0].envs)["GPUSHARE_MEMORY_LIMIT"] == "8GiB"

            # An application's XID (13) changes nothing; a GPU's own (79, fell off the bus)
            # turns that GPU's units Unhealthy, and says so in an event.
            nvml.events.put((uuid0, 13))
            nvml.events.put((uuid1, 79))
            devices = await next_list(stream)
            health = {d.ID: d.health for d in devices}
            assert {h for i, h in health.items() if i.startswith(uuid0)} == {"Healthy"}
            assert {h for i, h in health.items() if i.startswith(uuid1)} == {"Unhealthy"}
            await _until(lambda: len(kube_api.posts) == 2, "the XID event")
            event = kube_api.posts[1][2]
            assert event["reason"] == "GPUShareXidError" and "XID 79" in event["message"]
            assert uuid1 in event["message"]
            # An XID that names no device: every GPU.
            nvml.events.put((None, 48))
            devices = await next_list(stream)
            assert {d.health for d in devices} == {"Unhealthy"}
    finally:
        await plugin.stop()


async def test_a_scheduler_without_nvml_is_said_in_the_log_and_an_event(
    kubelet: KubeletStandIn, harness: Any, kube_api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    harness.scheduler(pool="8GiB")  # no NVML: it knows no GPU until a kernel brings one
    plugin = make_plugin(kubelet, harness, kube_api)
    plugin.log = logging.getLogger("test-device-plugin")
    plugin.events.log = plugin.log
    plugin.xids.log = plugin.log
    with caplog.at_level(logging.INFO, logger="test-device-plugin"):
        await plugin.start()
        try:
            request = await asyncio.wait_for(kubelet.requests.get(), 10)
            channel, stub = kubelet.plugin(request)
            async with channel:
                assert await next_list(stub.ListAndWatch(api.Empty())) == []
            await asyncio.sleep(0.3)  # more refreshes: the reason is said once, not each time
        finally:
            await plugin.stop()
    [(_, _, event)] = kube_api.posts
    assert event["reason"] == "GPUShareNoUnits"
    assert "0 units advertised" in event["message"] and "NVML" in event["message"]
    assert "runtimeClassName nvidia" in event["message"]
    logged = [r.getMessage() for r in caplog.records if "GPUShareNoUnits" in r.getMessage()]
    assert len(logged) == 1 and "NVML" in logged[0]
    # No NVML in this process either: the XID checks say why they are off.
    assert plugin.xid_health is not None and "NVML" in plugin.xid_health
    assert any("no XID health checks" in r.getMessage() for r in caplog.records)
