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
from local_users import kill, open_to_everyone, run_as, spawn_as
from local_users import shim as _shim
from local_users import until as _until
from test_utilization import UUID as NVML_UUID
from test_utilization import FakeNVMLProcesses

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync
from jupyter_gpushare.scheduler.shell.devices import nvml_pids_comparable

GIB = 1 << 30


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVMLProcesses:
    """A stand-in NVML whose per-process list the test fills, in place of pynvml."""
    if not nvml_pids_comparable():
        pytest.skip("the tests run in a pid namespace of their own: NVML's pids are not theirs")
    fake = FakeNVMLProcesses()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


async def _nvml_node(make_scheduler: Any, **extra: Any) -> Any:
    """A scheduler reading that NVML every 50 ms, a 4 GiB pool, open to every local user."""
    node = await make_scheduler(use_nvml=True, utilization_interval=0.05, pool_size="4GiB", **extra)
    open_to_everyone(node)
    return node


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
    local_users: Any, make_scheduler: Any, nvml: FakeNVMLProcesses, tmp_path: Any
) -> None:
    mallory = local_users("mallory")
    node = await _nvml_node(make_scheduler)
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


def _running(node: Any) -> list[dict[str, Any]]:
    return [c for c in _clients(node).values() if c["state"] == "running"]


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize("policy", ["count", "warn"])
async def test_memory_of_gpu_processes_that_never_registered_is_counted(
    local_users: Any,
    make_scheduler: Any,
    nvml: FakeNVMLProcesses,
    caplog: pytest.LogCaptureFixture,
    policy: str,
) -> None:
    """carol runs a GPU program without the shim (NVML lists it with 3 GiB); alice's and bob's
    2 GiB kernels would fit the 4 GiB pool together, but not beside carol's 3 GiB. Before, the
    scheduler ran them side by side on a card that did not have the room."""
    carol, alice, bob = local_users("carol"), local_users("alice"), local_users("bob")
    node = await _nvml_node(make_scheduler, unmanaged_memory=policy)
    path, gpu = node.socket_path, {"device_uuid": NVML_UUID}
    pid_c, rfd_c = spawn_as(carol, _sleep, 30.0)
    await _until(lambda: os.stat(f"/proc/{pid_c}").st_uid == carol.uid)  # it became carol
    nvml.processes[pid_c] = 3 * GIB
    kernels: list[tuple[int, int]] = []
    try:
        await _until(lambda: node.status_document()["devices"][0]["unmanaged_bytes"] == 3 * GIB)
        for user, name in ((alice, "a"), (bob, "b")):
            kernels.append(spawn_as(user, _shim, path, {**gpu, "client_id": name}, 2 * GIB, 30.0))
        await _until(lambda: {"a", "b"} <= set(_clients(node)))
        counted = policy == "count"
        want = 1 if counted else 2
        await _until(lambda: len(_running(node)) == want)
        (dev,) = node.status_document()["devices"]
        assert dev["pool_bytes"] == (GIB if counted else 4 * GIB), dev
        for _ in range(10):  # a half second of NVML readings
            assert len(_running(node)) == want, _running(node)
            await asyncio.sleep(0.05)
        logged = [r for r in caplog.records if "unmanaged GPU process" in r.getMessage()]
        assert len(logged) == 1 and f"uid={carol.uid}" in logged[0].getMessage(), logged
        # carol's program ends: the pool is whole again and both kernels run side by side.
        del nvml.processes[pid_c]
        await _until(lambda: len(_running(node)) == 2)
        assert node.status_document()["devices"][0]["pool_bytes"] == 4 * GIB
    finally:
        for pid, rfd in ((pid_c, rfd_c), *kernels):
            kill(pid)
            os.close(rfd)


async def test_a_client_that_left_is_not_unmanaged_while_its_process_exits(
    local_users: Any, make_scheduler: Any, nvml: FakeNVMLProcesses
) -> None:
    """Seen on an H100 (tests/gpu/test_gpu_captures.py, 2026-11-27): a kernel that said GOODBYE
    stays in NVML's list while its process exits, and was counted as an unmanaged process: the
    2 GiB pool fell to 0.75 GiB under the kernel still running. A process that was a client is
    not unmanaged while NVML still lists it."""
    alice = local_users("alice")
    node = await _nvml_node(make_scheduler)
    gpu = {"device_uuid": NVML_UUID}
    pid, rfd = spawn_as(alice, _shim, node.socket_path, {**gpu, "client_id": "a"}, 2 * GIB, 30.0)
    try:
        nvml.processes[pid] = 2 * GIB
        await _until(lambda: "a" in set(_clients(node)))
        kill(pid)  # its connection closes; NVML lists the process on, as while it exits
        await _until(lambda: "a" not in set(_clients(node)))
        for _ in range(10):  # a half second of NVML readings
            (dev,) = node.status_document()["devices"]
            assert dev["unmanaged_bytes"] == 0 and dev["pool_bytes"] == 4 * GIB, dev
            await asyncio.sleep(0.05)
    finally:
        kill(pid)
        os.close(rfd)


class _NoNVML:
    """pynvml on a node without NVML: every call fails."""

    def nvmlInit(self) -> None:
        raise RuntimeError("NVML Shared Library Not Found")


A13B_UUID = "GPU-a13b0000-0000-0000-0000-000000000001"


async def test_a13b_without_nvml_the_driver_sizes_the_gpu_not_a_hello(
    local_users: Any, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch, native_build: Any
) -> None:
    """No NVML on the node: mallory's kernel says first that the GPU holds 4.3e9 GiB. Before,
    that became everyone's pool. Now the scheduler asks the CUDA driver itself (in a child
    process) for its GPUs and their sizes; a HELLO neither adds a GPU nor sizes one."""
    monkeypatch.setitem(sys.modules, "pynvml", _NoNVML())
    monkeypatch.setenv("GPUSHARE_REAL_LIBCUDA", str(native_build.fake_dir / "libcuda.so.1"))
    monkeypatch.setenv("GPUSHARE_FAKE_UUID", A13B_UUID)
    monkeypatch.setenv("GPUSHARE_FAKE_DEVICE_TOTAL", "8GiB")
    mallory = local_users("mallory")
    node = await make_scheduler(use_nvml=True, utilization_interval=0)
    open_to_everyone(node)
    huge = 4_300_000_000 * GIB
    lie = {"client_id": "liar", "device_uuid": A13B_UUID, "device_total": huge}
    answers = await run_as(mallory, _shim, node.socket_path, lie, 0, 0.1)
    assert answers[0][0] == MsgType.WELCOME, answers
    (dev,) = node.status_document()["devices"]
    assert dev["uuid"] == A13B_UUID and dev["total_bytes"] == 8 * GIB, dev
    assert dev["index"] == 0
    # A made-up GPU is not added.
    other = {**lie, "client_id": "liar2", "device_uuid": "GPU-made-up"}
    answers = await run_as(mallory, _shim, node.socket_path, other, 0, 0.1)
    assert answers[0][0] == MsgType.ERROR, answers
    assert len(node.status_document()["devices"]) == 1


async def test_a20b_memory_a_registered_process_takes_past_its_shim_counts(
    local_users: Any, make_scheduler: Any, nvml: FakeNVMLProcesses
) -> None:
    """mallory's kernel registers and reports 1 GiB through its shim, but calls the real driver
    directly for 2 GiB more (bypassing the shim's hooks): NVML sees 3 GiB for her process. Her
    client counts as 3 GiB, the 2 GiB its shim never declared as pinned (no eviction can move
    them), and status shows it; alice's 2 GiB kernel waits instead of being run beside her in
    the 4 GiB pool. When NVML sees the memory go, alice runs."""
    mallory, alice = local_users("mallory"), local_users("alice")
    node = await _nvml_node(make_scheduler)
    path, gpu = node.socket_path, {"device_uuid": NVML_UUID}
    pid_m, rfd_m = spawn_as(mallory, _shim, path, {**gpu, "client_id": "m"}, GIB, 30.0)
    nvml.processes[pid_m] = 3 * GIB  # her shim's 1 GiB and 2 GiB straight from the driver
    kernels = [(pid_m, rfd_m)]
    try:
        await _until(lambda: _clients(node).get("m", {}).get("state") == "running")
        await _until(lambda: _clients(node)["m"]["used_bytes"] == 3 * GIB)
        assert _clients(node)["m"]["pinned_bytes"] == 2 * GIB, _clients(node)["m"]
        kernels.append(spawn_as(alice, _shim, path, {**gpu, "client_id": "a"}, 2 * GIB, 30.0))
        await _until(lambda: _clients(node).get("a", {}).get("state") == "waiting")
        for _ in range(10):  # a half second of NVML readings: she still waits
            assert _clients(node)["a"]["state"] == "waiting", _clients(node)["a"]
            await asyncio.sleep(0.05)
        nvml.processes[pid_m] = GIB  # the direct allocation is freed
        await _until(lambda: _clients(node)["a"]["state"] == "running")
    finally:
        for pid, rfd in kernels:
            kill(pid)
            os.close(rfd)
