"""A restarted scheduler does not count its returning clients as unmanaged memory.

Seen on an H100 (tests/gpu/test_gpu_reliability.py, 2026-11-27): the scheduler was restarted under
a running torch process; NVML listed that process (14.6 GiB) a second before its shim rejoined,
the scheduler counted it as an unmanaged GPU process and took it off the 24 GiB pool, and the
shim's WELCOME then gave it a pool of 8.9 GiB: its next allocation failed in the shim. While the
policy waits for the previous run's clients, the processes NVML lists are those clients.
"""

from __future__ import annotations

import time
from typing import Any

from sched_helpers import DEVICE, GiB

from jupyter_gpushare.scheduler.features import nvml_check as nc


def _pool(server: Any) -> int:
    (dev,) = server.status_document()["devices"]
    return int(dev["pool_bytes"])


async def test_returning_clients_are_not_unmanaged_while_the_scheduler_recovers(
    make_scheduler: Any, connect: Any
) -> None:
    server = await make_scheduler(pool_size="24GiB", unmanaged_memory="count")
    shim = await connect()
    await shim.hello("watcher")  # registers the device
    returning = {DEVICE.lower(): [nc.ProcessMemory(DEVICE.lower(), 4242, 15 * GiB, 0)]}

    server.policy.recover_until(time.monotonic() + 30.0)
    server._count_unmanaged(returning)
    assert _pool(server) == 24 * GiB, "a returning client's memory shrank the pool"

    # Once the window is over, a process NVML lists and no shim claims is unmanaged again.
    server.policy.recover_until(time.monotonic() - 1.0)
    server._count_unmanaged(returning)
    assert _pool(server) == 9 * GiB
