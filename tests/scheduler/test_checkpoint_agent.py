"""Who a checkpoint agent acts on (features/checkpoint_agent.py): only its own descendants of
its own uid, so that a scheduler cannot make a user's Jupyter server freeze any other process of
hers. The end-to-end tests with real separate uids are in
tests/reliability/test_deep_idle_service_account.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sched_helpers import FakeShim

from jupyter_gpushare.protocol import MsgType
from jupyter_gpushare.scheduler.features.checkpoint_agent import (
    CheckpointAgent,
    ancestors,
    runs_the_shim,
)
from jupyter_gpushare.shim import library_path


def test_an_agent_acts_on_its_descendants_only() -> None:
    agent = CheckpointAgent("/nonexistent.sock")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert os.getpid() in ancestors(child.pid)
        assert agent._may(child.pid) == ""
        # Its parent, a process of the same uid, is not its descendant: refused.
        assert "neither a descendant" in agent._may(os.getppid())
        assert "neither a descendant" in agent._may(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert "no process" in agent._may(child.pid)


def orphan(env: dict[str, str]) -> int:
    """A ``sleep`` whose parent has exited: no descendant of this process any more."""
    out = subprocess.run(
        ["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def test_an_agent_acts_on_a_shimmed_process_of_its_uid_that_it_did_not_start() -> None:
    """A kernel its server adopted after a restart (docs/reliability.md) is no descendant of
    the new server, but runs the shim: the agent acts on it; on a plain process it does not."""
    agent = CheckpointAgent("/nonexistent.sock")
    shim = Path(library_path())
    plain = orphan(dict(os.environ))
    shimmed = orphan({**os.environ, "LD_PRELOAD": str(shim)}) if shim.is_file() else 0
    try:
        assert os.getpid() not in ancestors(plain)
        assert "nor shimmed" in agent._may(plain)
        if shimmed:  # the package's shim is built in CI (native/build.py)
            deadline = time.monotonic() + 10
            while not runs_the_shim(shimmed) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.getpid() not in ancestors(shimmed)
            assert agent._may(shimmed) == ""
    finally:
        for pid in (plain, shimmed):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_an_agent_refuses_a_process_of_another_uid() -> None:
    """Even its own child, once that runs as another user (here: nobody, 65534)."""
    agent = CheckpointAgent("/nonexistent.sock")
    if os.getuid() != 0:
        assert "is not of uid" in agent._may(1)  # init is root's
        return
    child = subprocess.Popen(["sleep", "30"], user=65534, group=65534, extra_groups=[])
    try:
        assert os.getpid() in ancestors(child.pid)
        assert "is not of uid" in agent._may(child.pid)
    finally:
        child.kill()
        child.wait()


async def test_only_the_agent_asked_may_answer_a_call(make_scheduler: Any) -> None:
    """A call to alice's agent answered by mallory's (another registered agent) is refused and
    stays open: a forged ``ok`` would have the scheduler count alice's memory as gone."""
    sched = await make_scheduler()
    sched.fake_creds = [{"uid": 4001}, {"uid": 4002}]
    alice = await FakeShim.connect(sched.socket_path)
    mallory = await FakeShim.connect(sched.socket_path)
    for agent in (alice, mallory):
        await agent.send(MsgType.CONTROL, body={"action": "checkpoint_agent"})
        reply = await agent.expect(MsgType.CONTROL_REPLY)
        assert reply.get("body")["ok"] is True
    (alice_serial,) = [s for s, c in sched._agents.items() if c.peer.uid == 4001]
    fut = asyncio.get_running_loop().create_future()
    sched._agent_calls[7] = (alice_serial, fut)  # as _checkpoint_call leaves it
    forged = {"action": "checkpoint_done", "seq": 7, "ok": True, "code": 0}
    await mallory.send(MsgType.CONTROL, body=forged)
    err = await mallory.expect(MsgType.ERROR)
    assert "without a call" in str(err.get("message"))
    assert not fut.done()
    await alice.send(MsgType.CONTROL, body={**forged, "ok": False, "code": 700})
    await asyncio.wait_for(fut, 3)
    assert fut.result()["code"] == 700
