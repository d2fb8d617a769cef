"""Issue 22, item 6, as real separate uids: ``revoke_signal`` goes
to the process that connected, through a pidfd taken at HELLO, and never to whoever has its pid
now. Alice's holder passes its socket to a child and exits; bob's unrelated process is started
on alice's old pid (``ns_last_pid``, as pid reuse would do by itself in time); the revoke
deadline passes and the signal is due: bob's process lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import pytest
from local_users import _connect, collect, kill, open_to_everyone, spawn_as
from local_users import shim as _shim
from local_users import until as _until

from jupyter_gpushare.protocol import Message, MsgType, encode, read_message_sync

DEVICE = {"device_uuid": "GPU-hostile-0", "device_total": 8 << 30}
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _hold_then_hand_over(path: str, stop: str) -> int:
    """Alice: HELLO, REQUEST 1 GiB (granted), then a child keeps the socket and never reads it
    again, and this process exits: the pid the scheduler recorded is free. Returns that pid."""
    sock = _connect(path)
    sock.sendall(encode(Message(MsgType.HELLO, {"pid": os.getpid(), **DEVICE, "client_id": "h"})))
    assert read_message_sync(sock).type == MsgType.WELCOME  # type: ignore[union-attr]
    sock.sendall(encode(Message(MsgType.REQUEST, {"used_bytes": 1 << 30})))
    assert read_message_sync(sock).type == MsgType.GRANT  # type: ignore[union-attr]
    if os.fork() == 0:  # the child: only the socket stays open (not the result pipe)
        keep = sock.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, 4096)
        deadline = time.monotonic() + 60  # never outlive the test, whatever happens to it
        while not os.path.exists(stop) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    return os.getpid()


def _start_on_pid(argv: list[str], pid: int, user: Any) -> subprocess.Popen[bytes] | None:
    """``argv`` as ``user`` on exactly ``pid`` (ns_last_pid, retried: other processes fork too)."""
    for _ in range(50):
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(argv, user=user.uid, group=user.gid, extra_groups=[])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


async def test_a_reused_pid_is_never_signalled(
    local_users: Any, make_scheduler: Any, tmp_path: Any, caplog: Any
) -> None:
    if not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip("choosing a pid needs a writable ns_last_pid (root)")
    alice, bob, carol = local_users("alice"), local_users("bob"), local_users("carol")
    node = await make_scheduler(
        pool_size="4GiB",
        base_quantum=0.3,
        max_quantum=0.3,
        revoke_deadline_seconds=1.0,
        revoke_signal="SIGKILL",
        revoke_signal_grace=0.3,
    )
    open_to_everyone(node)
    path = node.socket_path
    # The stop file where alice can see it: tmp_path's parents are root's alone (0700), so alice's
    # child never saw a stop file there and slept on after every run, keeping alice's user.
    shared = tempfile.mkdtemp(prefix="gs-pidfd-")
    os.chmod(shared, 0o755)
    stop = os.path.join(shared, "stop")
    old_pid = await asyncio.get_running_loop().run_in_executor(
        None, collect, *spawn_as(alice, _hold_then_hand_over, path, stop), 30
    )
    bystander = _start_on_pid(["sleep", "60"], old_pid, bob)
    if bystander is None:
        open(stop, "w").close()
        pytest.skip(f"could not start a process on pid {old_pid}")
    caplog.set_level(logging.INFO)
    pid_c, rfd_c = spawn_as(carol, _shim, path, {**DEVICE, "client_id": "c"}, 7 << 29, 10.0)
    try:
        # Carol waits: the holder's quantum ends, REVOKE, its deadline (1 s), then the signal
        # after the grace (0.3 s). Wait for the scheduler to say what it did with the signal.
        await _until(
            lambda: bystander.poll() is not None or "not sending SIGKILL" in caplog.text, 10.0
        )
        assert bystander.poll() is None, "bob's process got the signal meant for alice's"
        assert f"pid {old_pid} has exited" in caplog.text or "gone" in caplog.text, caplog.text
    finally:
        open(stop, "w").close()
        shutil.rmtree(shared, ignore_errors=True)
        bystander.kill()
        bystander.wait()
        kill(pid_c)
        with contextlib.suppress(OSError):
            os.close(rfd_c)
