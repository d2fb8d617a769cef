"""GPU utilisation in the status: sampled through NVML off the event loop, cached, shown."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import types
from typing import Any

import pytest
from sched_helpers import *  # noqa: F403  (fixtures)

from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.scheduler.shell.devices import UtilizationSampler, nvml_pids_comparable

UUID = "GPU-00000000-1111-2222-3333-444444444444"


class FakeNVML(types.ModuleType):
    """Just enough of pynvml for discovery and utilisation."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.percent = 37
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return "handle-0"

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> str:
        if uuid.decode() != UUID:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle-0"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return UUID

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "Test GPU"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return types.SimpleNamespace(total=80 << 30, free=80 << 30, used=0)

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return types.SimpleNamespace(gpu=self.percent, memory=0)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


async def _utilization(server: Any, want: int, timeout: float = 5.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        dev = server.status_document()["devices"][0]
        if dev["utilization_percent"] == want:
            return dev
        assert asyncio.get_running_loop().time() < deadline, dev
        await asyncio.sleep(0.02)


async def test_status_shows_sampled_utilization(make_scheduler: Any, nvml: FakeNVML) -> None:
    server = await make_scheduler(use_nvml=True, utilization_interval=0.02)
    dev = await _utilization(server, 37)
    assert dev["uuid"] == UUID and dev["name"] == "Test GPU"
    nvml.percent = 81
    await _utilization(server, 81)
    await server.stop()
    assert nvml.shutdowns >= nvml.inits >= 1, "NVML was left initialised"


async def test_no_nvml_means_no_utilization(scheduler: Any) -> None:
    # Devices learnt from shims (no NVML) have no utilisation figure: null, not a made-up 0.
    assert scheduler._sampler is None
    scheduler._register_device(UUID, "Test GPU", 16 << 30)
    assert scheduler.status_document()["devices"][0]["utilization_percent"] is None


def test_sampler_leaves_out_devices_nvml_does_not_know(nvml: FakeNVML) -> None:
    sampler = UtilizationSampler()
    assert sampler.open() is None
    assert sampler.sample([UUID, "GPU-unknown"]) == {UUID: 37}
    sampler.close()
    assert sampler.sample([UUID]) == {}, "a closed sampler must not touch NVML"


class FakeNVMLProcesses(FakeNVML):
    """The stand-in pynvml, listing ``processes`` (pid -> bytes) on its GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.processes: dict[int, int] = {}
        self.gate = threading.Event()  # cleared: the sampler's next reading waits (in its thread)
        self.gate.set()

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        self.gate.wait(10.0)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.processes.items()]


async def _client(server: Any, key: str, want: int, timeout: float = 5.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        (client,) = server.status_document()["devices"][0]["clients"]
        if client[key] == want:
            return client
        assert asyncio.get_running_loop().time() < deadline, client
        await asyncio.sleep(0.02)


async def test_a_claim_counts_at_least_what_nvml_sees_its_process_hold(
    make_scheduler: Any, connect: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    if not nvml_pids_comparable():
        pytest.skip("the tests run in a pid namespace of their own: NVML's pids are not theirs")
    nvml = FakeNVMLProcesses()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    server = await make_scheduler(use_nvml=True, utilization_interval=0.02, pool_size="8GiB")
    shim = await connect()  # this process: SO_PEERCRED names our pid and uid
    await shim.hello("k", device=UUID)
    await shim.request(1 << 30)
    await shim.expect(MsgType.GRANT)
    nvml.processes[os.getpid()] = 3 << 30
    client = await _client(server, "used_bytes", 3 << 30)
    assert client["pinned_bytes"] == 2 << 30 and client["managed_bytes"] == 1 << 30
    try:
        # With the sampler held, its next claim (used = 0) is corrected as it comes.
        nvml.gate.clear()
        await asyncio.sleep(0.1)
        await shim.send(MsgType.MEMORY, used_bytes=0, managed_bytes=0, pinned_bytes=0)
        await _client(server, "managed_bytes", 0)
        assert (await _client(server, "used_bytes", 3 << 30))["pinned_bytes"] == 3 << 30
    finally:
        nvml.gate.set()
    # NVML no longer sees it: its own claim stands again.
    del nvml.processes[os.getpid()]
    await _client(server, "used_bytes", 0)
    corrected = [r for r in caplog.records if "memory claim corrected" in r.getMessage()]
    assert len(corrected) == 1  # once per client, however many samples corrected it
