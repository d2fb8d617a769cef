"""Raw escapes and forged lines through the log and /metrics (issue 22, item 10; A17 in
docs/reliability.md), as a real separate uid.

A peer's text reaches the scheduler's log and its metrics' labels: a device uuid learnt from a
``HELLO`` (no NVML), a shim's version, ids. Before the fix a newline in them forged a whole log
line and an ESC sequence reached the operator's terminal through the text log and ``/metrics``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from local_users import LocalUser, clients_of, kill, open_to_everyone, shim, spawn_as, until
from prometheus_client import generate_latest

FORGED = "GPU-x\n[I 12:00:00 gpushare] grant client=root\x1b]0;pwned\x07"  # 64 at most


@pytest.fixture(scope="module")
def attacker(local_users: Callable[[str], LocalUser]) -> LocalUser:
    return local_users("attack")


async def test_a17_peers_text_reaches_the_log_and_metrics_escaped(
    make_scheduler: Any, attacker: LocalUser, caplog: pytest.LogCaptureFixture
) -> None:
    node = await make_scheduler(pool_size="4GiB", metrics_in_process=True)
    open_to_everyone(node)
    caplog.set_level("DEBUG")
    hello = {"client_id": "a-k", "device_uuid": FORGED, "device_total": 8 << 30}
    hello["version"] = "1.0\x1b[2J\n[W forged warning]"
    pid, rfd = spawn_as(attacker, shim, str(node.socket_path), hello, 1 << 20, 30.0)
    try:
        await until(lambda: clients_of(node).get("a-k", {}).get("state") == "running")
        node.refresh_metrics()
        exposition = generate_latest(node.metrics.registry).decode()
    finally:
        kill(pid)
        os.close(rfd)
    lines = [r.getMessage() for r in caplog.records]
    assert any("GPU-x" in line for line in lines), lines  # the device was logged ...
    assert all(line.isprintable() for line in lines), [x for x in lines if not x.isprintable()]
    assert "GPU-x\\n[I 12:00" in "".join(lines)  # ... with its newline escaped
    assert "\x1b" not in exposition and "\x07" not in exposition
    assert "GPU-x" in exposition  # the label is there, escaped
