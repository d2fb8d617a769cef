"""The scheduler's ``history`` control action (docs/rest-api.yaml, /gpushare/api/history): the
last hour of each kernel as the viewer may see it, over the socket of a real scheduler."""

from __future__ import annotations

from typing import Any

from sched_helpers import MiB

from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.scheduler_client import SchedulerClient


async def test_history_as_each_viewer_may_see_it(
    make_scheduler: Any, connect: Any, sock_path: str
) -> None:
    scheduler = await make_scheduler()
    scheduler.own_uid = 5000
    # Connections: 0 alice's kernel, 1 bob's kernel, 2 alice asking, 3 an admin asking.
    scheduler.fake_creds = [{"uid": 1001}, {"uid": 1002}, {"uid": 1001}, {"uid": 1003}]
    a = await connect()
    await a.hello("alice-k")
    await a.request(100 * MiB)
    await a.expect(MsgType.GRANT)
    b = await connect()
    await b.hello("bob-k")
    await b.request(200 * MiB)
    client = SchedulerClient(sock_path)

    mine = (await client.control("history"))["history"]
    assert set(mine["kernels"]) == {"alice-k"}, mine  # bob's kernel is his
    points = mine["kernels"]["alice-k"]["points"]
    assert points[-1][5] == "running" and points[-1][1] > 0
    assert len(mine["users"]) == 2 and len(mine["devices"]) == 1  # sums and GPUs: everyone's
    assert mine["window_seconds"] == 3600

    scheduler.admin_uids = [1003]
    everything = (await client.control("history"))["history"]
    assert set(everything["kernels"]) == {"alice-k", "bob-k"}
    assert everything["kernels"]["bob-k"]["points"][-1][1] > 0  # resident, as it asked for
