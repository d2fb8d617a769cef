"""The scheduler's ``place`` control action on a node with several GPUs: the chosen device,
reservations for kernels that have not connected yet, pins, errors, and the status per GPU."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sched_helpers import GiB, MiB

from jupyter_gpushare.cli import format_status
from jupyter_gpushare.protocol import ErrorCode, MsgType
from jupyter_gpushare.scheduler.shell import server as server_module
from jupyter_gpushare.scheduler.shell.devices import DeviceInfo, Discovery
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError

G0 = "GPU-00000000-aaaa-0000-0000-000000000000"
G1 = "GPU-11111111-bbbb-0000-0000-000000000001"


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[DeviceInfo]:
    """NVML answers with two 80 GiB GPUs."""
    devices = [DeviceInfo(0, G0, "Test GPU", 80 * GiB), DeviceInfo(1, G1, "Test GPU", 80 * GiB)]

    async def discover() -> Discovery:
        return Discovery(devices)

    monkeypatch.setattr(server_module, "discover_devices_async", discover)
    return devices


async def _sched(make_scheduler: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("use_nvml", True)
    kwargs.setdefault("utilization_interval", 0)
    kwargs.setdefault("pool_size", "10GiB")
    kwargs.setdefault("placement_estimate", "1GiB")
    return await make_scheduler(**kwargs)


async def test_concurrent_placements_spread_when_they_fit_only_apart(
    make_scheduler: Any, two_gpus: Any, sock_path: str
) -> None:
    """Two kernels of 6 GiB each, started at the same moment, on two GPUs of 10 GiB pools: each
    fits a GPU alone, not both on one. The reservation of the first sends the second elsewhere."""
    await _sched(make_scheduler)
    client = SchedulerClient(sock_path)
    a, b = await asyncio.gather(client.place("ka", 6 * GiB), client.place("kb", 6 * GiB))
    assert {a["device"], b["device"]} == {G0, G1}
    assert a["fits"] and b["fits"] and a["devices"] == b["devices"] == 2
    assert {a["index"], b["index"]} == {0, 1}
    # A third one fits nowhere: it still gets a GPU (it will take turns there).
    c = await client.place("kc", 6 * GiB)
    assert not c["fits"] and c["free_bytes"] == 4 * GiB


async def test_no_quota_means_the_default_estimate(
    make_scheduler: Any, two_gpus: Any, sock_path: str
) -> None:
    await _sched(make_scheduler, placement_estimate="3GiB")
    client = SchedulerClient(sock_path)
    first = await client.place("k1")
    assert first["need"] == 3 * GiB and first["index"] == 0  # equal GPUs: the lower index
    second = await client.place("k2")
    assert second["index"] == 1 and second["free_bytes"] == 10 * GiB
    third = await client.place("k3")
    assert third["free_bytes"] == 7 * GiB  # both GPUs hold one 3 GiB reservation
    # Placing the same kernel again (a restart) replaces its reservation, it does not add one.
    again = await client.place("k3")
    assert again["device"] == third["device"] and again["free_bytes"] == 7 * GiB


async def test_a_connected_kernel_counts_instead_of_its_reservation(
    make_scheduler: Any, two_gpus: Any, connect: Any, sock_path: str
) -> None:
    await _sched(make_scheduler)
    client = SchedulerClient(sock_path)
    placed = await client.place("big", 5 * GiB)
    shim = await connect()
    await shim.hello("big", device=placed["device"], total=80 * GiB)
    await shim.request(7 * GiB)
    await shim.expect(MsgType.GRANT)
    await asyncio.sleep(0.05)
    # It uses 7 GiB now: that counts (the 5 GiB reservation ended when it connected).
    other = await client.place("next", 2 * GiB)
    assert other["device"] != placed["device"] and other["free_bytes"] == 10 * GiB
    doc = await client.status()
    by_uuid = {d["uuid"]: d for d in doc["devices"]}
    assert by_uuid[placed["device"]]["clients"][0]["id"] == "big"
    assert {d["index"] for d in doc["devices"]} == {0, 1}


async def test_reservations_expire(make_scheduler: Any, two_gpus: Any, sock_path: str) -> None:
    await _sched(make_scheduler, placement_timeout=0.2)
    client = SchedulerClient(sock_path)
    first = await client.place("slow", 8 * GiB)
    assert (await client.place("x", GiB))["device"] != first["device"]
    await asyncio.sleep(0.3)  # neither connected: both reservations are gone
    y = await client.place("y", GiB)
    assert y["free_bytes"] == 10 * GiB and y["index"] == 0


async def test_pins_and_errors(make_scheduler: Any, two_gpus: Any, sock_path: str) -> None:
    await _sched(make_scheduler)
    client = SchedulerClient(sock_path)
    pinned = await client.place("p", 20 * GiB, device="1")
    assert pinned["device"] == G1 and pinned["reason"] == "pinned" and not pinned["fits"]
    assert (await client.place("q", device=G1.lower()))["index"] == 1
    assert (await client.place("r", device=1))["device"] == G1
    with pytest.raises(SchedulerError) as err:
        await client.place("s", device="7")
    assert err.value.code == ErrorCode.BAD_REQUEST and "no device with index 7" in err.value.message
    for body, text in (
        ({"client": ""}, "'client'"),
        ({"client": "c", "need": -1}, "'need'"),
        ({"client": "c", "need": "1GiB"}, "'need'"),
        ({"client": "c", "device": [1]}, "'device'"),
    ):
        with pytest.raises(SchedulerError, match=text) as err:
            await client.control("place", **body)
        assert err.value.code == ErrorCode.BAD_REQUEST


async def test_only_the_gpus_the_kernel_can_reach(
    make_scheduler: Any, two_gpus: Any, sock_path: str
) -> None:
    """A Jupyter server in a container given GPU 1 only: its kernels go there, even when GPU 0
    has more room."""
    await _sched(make_scheduler)
    client = SchedulerClient(sock_path)
    await client.place("elsewhere", 8 * GiB, device=1)
    placed = await client.place("k", GiB, reachable=[G1.lower()])
    assert placed["device"] == G1 and placed["free_bytes"] == 2 * GiB
    with pytest.raises(SchedulerError, match="none of the GPUs the kernel can reach") as err:
        await client.place("k", reachable=["GPU-not-here"])
    assert err.value.code == ErrorCode.BAD_REQUEST
    for bad in ("GPU-1", [1], ["x" * 65], ["GPU-1"] * 65):
        with pytest.raises(SchedulerError, match="'reachable'"):
            await client.control("place", client="k", reachable=bad)


async def test_without_any_known_gpu_place_says_not_found(
    make_scheduler: Any, sock_path: str
) -> None:
    await make_scheduler()  # no NVML, and no shim connected yet: no device is known
    with pytest.raises(SchedulerError, match="no GPU is known") as err:
        await SchedulerClient(sock_path).place("k")
    assert err.value.code == ErrorCode.NOT_FOUND


async def test_status_text_shows_each_gpu_with_its_clients(
    make_scheduler: Any, two_gpus: Any, connect: Any, sock_path: str
) -> None:
    await _sched(make_scheduler)
    for name, uuid in (("on0", G0), ("on1", G1)):
        shim = await connect()
        await shim.hello(name, device=uuid)
        await shim.request(100 * MiB)
        await shim.expect(MsgType.GRANT)
    text = format_status(await SchedulerClient(sock_path).status())
    gpu0, gpu1 = text.index(f"GPU 0: {G0}"), text.index(f"GPU 1: {G1}")
    assert gpu0 < text.index("on0") < gpu1 < text.index("on1"), text
