"""Issue 22, item 8, as real separate uids: memory claims the scheduler must not believe.

A14d: mallory's kernel is granted the GPU, then says it released it with all its memory evicted
to the host (``RELEASED`` with the evict flag, ``MEMORY`` with ``evicted_bytes = used_bytes``),
while NVML still sees her process hold 3 GiB on the card. Off its turn a client's footprint is
its pinned memory, so before, the 3 GiB counted as nothing and the next kernels were sized into
a GPU that was not free. NVML's reading, taken after her eviction, now counts: what she says is
on the host but NVML sees on the card is pinned.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import pytest
from local_users import clients_of as _clients
from local_users import kill, spawn_as
from local_users import until as _until
from test_utilization import UUID as NVML_UUID
from test_utilization import FakeNVMLProcesses

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler.devices import nvml_pids_comparable

GIB = 1 << 30


def _evicted_liar(path: str, stop: str) -> list[int]:
    """mallory: takes a turn with 3 GiB, then claims it all evicted and keeps it."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(path)
    hello = {"pid": os.getpid(), "client_id": "liar", "device_uuid": NVML_UUID}
    sock.sendall(encode(Message(MsgType.HELLO, hello)))
    got = [read_message_sync(sock)]
    mem = {"used_bytes": 3 * GIB, "managed_bytes": 3 * GIB}
    sock.sendall(encode(Message(MsgType.REQUEST, mem)))
    got.append(read_message_sync(sock))  # GRANT
    sock.sendall(encode(Message(MsgType.RELEASED, {"flag": 1, "bytes_moved": 3 * GIB})))
    sock.sendall(encode(Message(MsgType.MEMORY, {**mem, "evicted_bytes": 3 * GIB})))
    while not os.path.exists(stop):
        time.sleep(0.05)
    sock.close()
    return [int(m.type) for m in got if m is not None]


async def test_a14d_memory_claimed_evicted_that_nvml_sees_on_the_card_counts(
    local_users: Any, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    if not nvml_pids_comparable():
        pytest.skip("the tests run in a pid namespace of their own: NVML's pids are not theirs")
    nvml = FakeNVMLProcesses()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    mallory = local_users("mallory")
    node = await make_scheduler(use_nvml=True, utilization_interval=0.05, pool_size="4GiB")
    os.chmod(os.path.dirname(node.socket_path), 0o755)
    os.chmod(node.socket_path, 0o666)
    stop = str(tmp_path / "stop")
    pid, rfd = spawn_as(mallory, _evicted_liar, node.socket_path, stop)
    nvml.processes[pid] = 3 * GIB
    try:
        # Her claim arrived: released, all 3 GiB "on the host".
        await _until(lambda: _clients(node).get("liar", {}).get("state") not in (None, "running"))
        await asyncio.sleep(0.3)  # several NVML readings taken after her eviction
        liar = _clients(node)["liar"]
        assert liar["pinned_bytes"] == 3 * GIB, liar
        (dev,) = node.status_document()["devices"]
        assert dev["resident_bytes"] >= 3 * GIB, dev
        # Once her process frees the memory (NVML sees it go), her claim stands again.
        nvml.processes[pid] = 256 << 20
        await _until(lambda: _clients(node)["liar"]["pinned_bytes"] == 256 << 20)
    finally:
        open(stop, "w").close()
        kill(pid)
        os.close(rfd)
