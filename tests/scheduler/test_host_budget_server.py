"""The node's host budget in the scheduler (docs/architecture.md, "Host memory is a budget"): the
budget from the node (auto), the shims' host memory in the status and the metrics, STAGING and
the no_room refusal on the wire, and the waiter's reason."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from jupyter_gpushare.protocol import ErrorCode, Message, MsgType
from jupyter_gpushare.scheduler.shell.host_memory import cgroup_limit, mem_info, resolve_budget
from jupyter_gpushare.scheduler_client import SchedulerClient

MiB = 1 << 20
GiB = 1 << 30


async def _drain(shim: Any) -> list[Message]:
    """What the scheduler sends ``shim`` until it says nothing for 0.5 s."""
    got: list[Message] = []
    while True:
        try:
            msg = await shim.recv(0.5)
        except (TimeoutError, asyncio.TimeoutError):
            return got
        if msg is None:
            return got
        got.append(msg)


def test_auto_is_the_available_memory_or_the_cgroup_limit_less_the_reserve(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       134217728 kB\nMemAvailable:   125829120 kB\n")
    info = mem_info(meminfo)
    assert info == {"MemTotal": 128 * GiB, "MemAvailable": 120 * GiB}
    # 128 GiB of RAM: the reserve is 20% of it (25.6 GiB), more than the 4 GiB floor.
    auto = resolve_budget("auto", "auto", info, limit=None)
    assert auto.budget == 120 * GiB - int(128 * GiB * 0.20), auto
    assert "MemAvailable" in auto.how
    # A cgroup limit below what is available is what the node gives the scheduler.
    capped = resolve_budget("auto", "4GiB", info, limit=64 * GiB)
    assert capped.budget == 60 * GiB and "cgroup limit" in capped.how
    # A small node keeps the 4 GiB floor; what gpushare holds already is its own.
    small = {"MemTotal": 16 * GiB, "MemAvailable": 10 * GiB}
    assert resolve_budget("auto", "auto", small, held=2 * GiB).budget == 8 * GiB
    assert resolve_budget("24GiB", "auto", small).budget == 24 * GiB
    assert resolve_budget(0, "auto", small).budget == 0  # off


def test_the_cgroup_limit_is_read_for_v2_and_v1(tmp_path: Path):
    root = tmp_path / "cgroup"
    (root / "user.slice" / "gs").mkdir(parents=True)
    (root / "user.slice" / "gs" / "memory.max").write_text("8589934592\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/user.slice/gs\n")
    assert cgroup_limit(proc, root) == 8 * GiB
    (root / "user.slice" / "gs" / "memory.max").write_text("max\n")
    assert cgroup_limit(proc, root) is None
    (root / "memory" / "docker").mkdir(parents=True)
    (root / "memory" / "docker" / "memory.limit_in_bytes").write_text("4294967296\n")
    proc.write_text("12:memory:/docker\n1:cpu,cpuacct:/docker\n")
    assert cgroup_limit(proc, root) == 4 * GiB
    (root / "memory" / "docker" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_limit(proc, root) is None  # v1's "no limit"


async def test_host_memory_in_status_metrics_and_on_the_wire(
    make_scheduler: Any, connect: Any, sock_path: str
) -> None:
    server = await make_scheduler(host_budget="1GiB", metrics_in_process=True)
    a, w = await connect(), await connect()
    await a.hello("a")
    await w.hello("w", user="other")
    # a reports what its engine holds: STAGING tells it its share (all it holds on the device).
    await a.send(
        MsgType.REQUEST,
        used_bytes=600 * MiB,
        managed_bytes=600 * MiB,
        pinned_bytes=0,
        evicted_bytes=0,
        host_bytes=200 * MiB,
        staging_bytes=200 * MiB,
    )
    got = await _drain(a)
    assert any(m.type == MsgType.GRANT for m in got), got
    # Before its grant it had nothing on the device (0), then all of it: 600 MiB in whole
    # 32 MiB units.
    allowances = [m["staging_bytes"] for m in got if m.type == MsgType.STAGING]
    assert allowances[-1] == 608 * MiB, got
    doc = await SchedulerClient(sock_path).status()
    assert doc["host"]["budget_bytes"] == GiB and doc["host"]["held_bytes"] == 200 * MiB
    assert list(doc["host"]["by_user"].values()) == [200 * MiB]  # the uid's user, one
    (client,) = [c for c in doc["devices"][0]["clients"] if c["id"] == "a"]
    assert client["host_bytes"] == 200 * MiB and client["staging_allowed_bytes"] == 608 * MiB
    server.refresh_metrics()
    text = generate_latest(server.metrics.registry).decode()
    values = dict(re.findall(r"^(gpushare_host_\w+) (\S+)$", text, re.M))
    assert float(values["gpushare_host_budget_bytes"]) == GiB, values
    assert float(values["gpushare_host_held_bytes"]) == 200 * MiB, values
    # A waiter more than the pool (1 GiB) and the budget (1 GiB) together: refused, once.
    await w.request(2 * GiB + 64 * MiB)
    err = await w.expect(MsgType.ERROR)
    assert err["error_code"] == ErrorCode.NO_ROOM and "can never fit" in err["message"]
    await w.request(2 * GiB + 64 * MiB)
    assert not [m for m in await _drain(w) if m.type == MsgType.ERROR]
