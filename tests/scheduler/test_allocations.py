"""Per-allocation sockets (features/allocations.py): the device plugin's ceilings, in process.

The device plugin's end to end test is tests/deviceplugin/test_allocation_ceiling.py; here the
rules that hold whatever the plugin does: the ceiling caps every quota on the allocation's
socket (an admin's set_quota included), peers there are never admins, the state file is
private and a bad one fails closed, and units reused retire their old allocation."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from sched_helpers import DEVICE, GiB

from jupyter_gpushare.deviceplugin.config import ContainerSetup
from jupyter_gpushare.deviceplugin.plugin import allocation_host_dir
from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.scheduler.features.allocations import (
    Allocation,
    AllocationRequest,
    AllocationStore,
    cap_quota,
    check_allocation_request,
    prunable,
    superseded,
)
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerError


def test_cap_quota_only_lowers() -> None:
    assert cap_quota(0, 4 * GiB) == 4 * GiB  # no claim: the ceiling
    assert cap_quota(64 * GiB, 4 * GiB) == 4 * GiB
    assert cap_quota(2 * GiB, 4 * GiB) == 2 * GiB
    assert cap_quota(64 * GiB, 0) == 64 * GiB  # the shared socket: no ceiling
    assert cap_quota(0, 0) == 0


def test_allocation_requests_are_checked() -> None:
    assert check_allocation_request({"ceiling": GiB, "units": ["a", "b"]}) == AllocationRequest(
        GiB, ("a", "b")
    )
    for bad in (
        None,
        {"units": ["a"]},
        {"ceiling": 0, "units": ["a"]},
        {"ceiling": True, "units": ["a"]},
        {"ceiling": "1GiB", "units": ["a"]},
        {"ceiling": GiB, "units": []},
        {"ceiling": GiB, "units": "a"},
        {"ceiling": GiB, "units": [1]},
    ):
        assert isinstance(check_allocation_request(bad), str), bad


def test_superseded_are_those_sharing_a_unit() -> None:
    allocs = [Allocation("x", GiB, ("u0", "u1")), Allocation("y", GiB, ("u2",))]
    assert superseded(allocs, ["u1", "u5"]) == ["x"]
    assert superseded(allocs, ["u1", "u2"]) == ["x", "y"]
    assert superseded(allocs, ["u3"]) == []


def test_prunable_needs_the_whole_grace_unheld_and_unused() -> None:
    a, b, c = (Allocation(x, GiB, (f"u-{x}",)) for x in "abc")
    retire, since = prunable([a, b, c], ["u-a"], ["c"], now=10.0, grace=5.0, unheld_since={})
    assert (retire, since) == ([], {"b": 10.0})  # b is unheld from now on; a held, c in use
    retire, since = prunable([a, b, c], ["u-a"], ["c"], 14.9, 5.0, since)
    assert (retire, since) == ([], {"b": 10.0})
    retire, since = prunable([a, b, c], ["u-a", "u-b"], [], 15.0, 5.0, since)
    assert (retire, since) == ([], {"c": 15.0})  # held again: b's clock restarts; c is unused
    retire, since = prunable([a, b, c], ["u-a"], [], 20.0, 5.0, since)
    assert (retire, since) == (["c"], {"b": 20.0})
    assert prunable([a], [], [], 0.0, 0.0, {}) == (["a"], {})


def test_store_is_private_and_round_trips(tmp_path: Path) -> None:
    store = AllocationStore(str(tmp_path / "state"))
    assert store.load() == []
    allocs = [Allocation("ab12", 4 * GiB, ("GPU-a-0", "GPU-a-1"))]
    umask = os.umask(0)  # a permissive umask does not widen the modes
    try:
        store.save(allocs)
    finally:
        os.umask(umask)
    assert store.load() == allocs
    assert stat.S_IMODE(os.stat(store.state_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600


def test_the_plugin_maps_the_directory_to_the_node() -> None:
    setup = ContainerSetup(
        unit=GiB,
        scheduler_socket="/plugin/run/scheduler.sock",
        host_socket_dir="/run/gpushare",
        container_socket_dir="/run/gpushare",
        socket_name="scheduler.sock",
        dev_root="/dev",
        device_nodes=False,
    )
    assert allocation_host_dir("/plugin/run/alloc/ab", setup) == "/run/gpushare/alloc/ab"
    with pytest.raises(ValueError):
        allocation_host_dir("/elsewhere/ab", setup)


async def test_ceiling_caps_hello_and_set_quota_and_peers_are_not_admins(
    make_scheduler: Any, connect: Any, sock_path: str
) -> None:
    sched = await make_scheduler(pool_size="20GiB")
    admin = SchedulerClient(sock_path)  # the scheduler's own uid: an admin
    reply = await admin.control("allocate", ceiling=4 * GiB, units=["GPU-a-0"])
    directory = reply["directory"]
    assert os.path.dirname(directory) == os.path.join(os.path.dirname(sock_path), "alloc")
    pod_socket = os.path.join(directory, reply["socket"])
    assert reply["socket"] == os.path.basename(sock_path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o755

    pod = await connect(pod_socket)
    welcome = await pod.hello("k1", quota=64 * GiB)
    assert welcome["quota"] == 4 * GiB
    lower = await connect(pod_socket)
    assert (await lower.hello("k2", quota=GiB))["quota"] == GiB
    free = await connect(sock_path)  # the shared socket: its own claim
    assert (await free.hello("k3", quota=64 * GiB))["quota"] == 64 * GiB

    # An admin cannot lift it; the client is told the capped quota.
    assert (await admin.set_quota("k1", 32 * GiB))["quota"] == 4 * GiB
    msg = await pod.expect(MsgType.SET_QUOTA)
    assert msg["quota"] == 4 * GiB
    clients = {c["id"]: c for d in (await admin.status())["devices"] for c in d["clients"]}
    assert clients["k1"]["quota_bytes"] == 4 * GiB
    await admin.control("reload")  # re-applies ceilings: the capped quota is not a change
    await pod.expect_nothing()

    # Same uid as the scheduler, but on the pod's socket: not an admin.
    pod_admin = SchedulerClient(pod_socket)
    with pytest.raises(SchedulerError, match="may not allocate"):
        await pod_admin.control("allocate", ceiling=64 * GiB, units=["GPU-a-1"])
    with pytest.raises(SchedulerError, match="may not reload"):
        await pod_admin.control("reload")
    with pytest.raises(SchedulerError, match="may not prune"):
        await pod_admin.control("prune_allocations", held=[], grace=0)
    with pytest.raises(SchedulerError, match="'grace'"):
        await admin.control("prune_allocations", held=[], grace=-1)
    assert DEVICE in {d["uuid"] for d in (await admin.status())["devices"]}
    del sched


async def test_reused_units_retire_and_a_bad_state_file_fails_closed(
    make_scheduler: Any, sock_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    sched = await make_scheduler()
    admin = SchedulerClient(sock_path)
    first = await admin.control("allocate", ceiling=2 * GiB, units=["u0", "u1"])
    second = await admin.control("allocate", ceiling=GiB, units=["u2"])
    third = await admin.control("allocate", ceiling=GiB, units=["u1"])
    assert not os.path.exists(first["directory"])
    assert os.path.isdir(second["directory"]) and os.path.isdir(third["directory"])
    state = Path(sock_path).parent / "state" / "allocations.json"
    ids = {a["id"] for a in json.loads(state.read_text())["allocations"]}
    assert ids == {second["allocation"], third["allocation"]}
    await sched.stop()

    state.write_text("{not json")
    sched = await make_scheduler()
    assert "cannot read" in caplog.text
    # Fail closed: the pods of the lost allocations find no socket rather than one unbounded.
    assert not os.path.exists(os.path.join(second["directory"], second["socket"]))
