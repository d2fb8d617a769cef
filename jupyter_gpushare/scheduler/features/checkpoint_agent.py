"""A checkpoint agent: the driver's process checkpoint, made by a process of the kernel's own user.

The driver lets a process lock, checkpoint, restore and unlock another one only as ptrace would:
root, or the same user. A node scheduler that runs as a service account (deploy/systemd) is
neither for its users' kernels. The user's Jupyter server is: it started the kernel (its parent,
which even a ``ptrace_scope`` of 1 allows) and runs as its user. So the server holds one
connection to the node scheduler on which it offers to make those calls (docs/protocol.md,
"Checkpoint agents"); the scheduler asks it, for a kernel of the agent's own uid that descends
from the agent, and never makes the calls itself where it may not.

Who may ask whom, checked on both sides:

* the scheduler registers an agent under the uid ``SO_PEERCRED`` gives for its connection, and
  asks an agent only for a client of that uid whose process descends from the agent's process
  (``/proc``'s parent links, in the scheduler's pid namespace: the pid of a client is the one
  its socket proved, never one a message claims);
* the agent acts only on a pid of its own uid that is its own descendant or runs the shim (a
  kernel adopted after the server restarted, docs/reliability.md): a scheduler cannot make a
  user's server freeze her other processes. The scheduler prefers the agent above the client, and
  otherwise asks another agent of the same uid (the driver may then refuse a non-ancestor where
  Yama's ``ptrace_scope`` is 1: the call fails and the kernel stays awake).

Failure modes: the agent's connection closes while a call is in flight (the server died): the
scheduler does not know what the driver did, so it treats the kernel as asleep and wakes it
through the next agent of that user (a wake restores what was checkpointed and unlocks what was
locked, and does nothing to a running process). The kernel dies mid-call: the call fails, the
kernel's connection closes and the scheduler forgets it.

Run it by hand (a kernel started outside Jupyter, or a test):
``python -m jupyter_gpushare.scheduler.features.checkpoint_agent --socket PATH -- COMMAND ...`` runs
COMMAND under the shim (as ``gpushare run`` does), as its child, and serves until it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from typing import Any

from ...identity import ENV_TOKEN, ENV_USER
from ...paths import socket_distrust
from ...protocol import Message, MsgType, read_message, write_message
from .checkpoint import CheckpointAPI, CheckpointError
from .checkpoint import load_cached as load_checkpoint_api

__all__ = [
    "CheckpointAgent",
    "ancestors",
    "keep_agent",
    "run_checkpoint",
    "runs_the_shim",
    "serve_while",
]

#: CUresult-like codes of the agent's own refusals (the driver's codes are positive).
REFUSED = -3

log = logging.getLogger("jupyter_gpushare.checkpoint_agent")


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """The parent, grandparent, ... of ``pid`` (from ``/proc``; empty when it is gone)."""
    out: list[int] = []
    while pid > 1 and len(out) < limit:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            break
        # pid (comm) state ppid ...: comm may hold spaces and parentheses; split after the last.
        fields = stat[stat.rfind(b")") + 2 :].split()
        pid = int(fields[1]) if len(fields) > 1 else 0
        if pid <= 0:
            break
        out.append(pid)
    return out


def runs_the_shim(pid: int) -> bool:
    """Whether ``pid`` has libgpushare loaded (a kernel the server adopted after a restart is
    no descendant of the new server, but it is a gpushare client of the same user)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return any(b"libgpushare" in line for line in f)
    except OSError:
        return False


def run_checkpoint(api: CheckpointAPI, op: str, pid: int) -> None:
    """``sleep`` (lock + checkpoint) or ``wake`` (restore + unlock) ``pid``; blocking."""
    if op == "sleep":
        api.sleep(pid)
    elif op == "wake":
        api.wake(pid)
    else:
        raise CheckpointError(f"checkpoint {op!r}", 1)


class CheckpointAgent:
    """Offers the checkpoint of this process's descendants to the scheduler at ``socket_path``."""

    def __init__(self, socket_path: str, library: str = "libcuda.so.1") -> None:
        self.socket_path = socket_path
        self.library = library
        self.done = 0  # calls made (tests read it)

    def _may(self, pid: int) -> str:
        """Why the agent refuses ``pid`` ('' when it may act on it)."""
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return f"no process {pid}"
        if owner != os.getuid():
            return f"process {pid} is not of uid {os.getuid()}"
        if os.getpid() in ancestors(pid) or runs_the_shim(pid):
            return ""
        return f"process {pid} is neither a descendant of the agent ({os.getpid()}) nor shimmed"

    async def _serve_one(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        seq, op, pid = body.get("seq"), str(body.get("op")), body.get("pid")
        answer: dict[str, Any] = {"action": "checkpoint_done", "seq": seq, "ok": False}
        t0 = time.monotonic()
        why = self._may(pid) if isinstance(pid, int) and pid > 0 else f"bad pid {pid!r}"
        if why:
            answer |= {"code": REFUSED, "error": why}
        else:
            loop = asyncio.get_running_loop()
            api = await loop.run_in_executor(None, load_checkpoint_api, self.library, 10_000)
            if isinstance(api, str):
                answer |= {"code": 801, "error": api}
            else:
                try:
                    await loop.run_in_executor(None, run_checkpoint, api, op, pid)
                    answer |= {"ok": True, "code": 0}
                except CheckpointError as exc:
                    answer |= {"code": exc.code, "error": str(exc)}
        answer["ms"] = round((time.monotonic() - t0) * 1000, 1)
        self.done += 1
        log.info("gpushare checkpoint agent: %s pid=%s: %s", op, pid, answer)
        await write_message(writer, Message(MsgType.CONTROL, {"body": answer}))

    async def run(self) -> None:
        """Serve until the connection closes (or the task is cancelled)."""
        why = socket_distrust(self.socket_path)  # as every client checks (paths.py)
        if why is not None:
            raise ConnectionError(why)
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        try:
            hello = {"action": "checkpoint_agent"}
            fields: dict[str, Any] = {"body": hello}
            # On a uid that hub users share, the scheduler knows a peer only by the user and
            # token the hub gave its server (docs/protocol.md), as for every other client.
            for key, env in (("user", ENV_USER), ("token", ENV_TOKEN)):
                if os.environ.get(env):
                    fields[key] = os.environ[env]
            await write_message(writer, Message(MsgType.CONTROL, fields))
            first = await read_message(reader)
            if first is None or first.type != MsgType.CONTROL_REPLY:
                raise ConnectionError(f"the scheduler refused the agent: {first}")
            tasks: set[asyncio.Task[None]] = set()
            while (msg := await read_message(reader)) is not None:
                body = msg.get("body")
                if (
                    msg.type == MsgType.CONTROL
                    and isinstance(body, dict)
                    and body.get("action") == "checkpoint"
                ):
                    task = asyncio.ensure_future(self._serve_one(writer, body))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def keep_agent(socket_path: str, library: str = "libcuda.so.1") -> None:
    """An agent for as long as the task runs: it connects again after the scheduler restarts
    (1 s, doubling to 30 s). The Jupyter server runs this in node mode (serverextension)."""
    delay = 1.0
    while True:
        agent = CheckpointAgent(socket_path, library)
        try:
            await agent.run()
            delay = 1.0
        except (OSError, ConnectionError) as exc:
            log.debug("gpushare checkpoint agent: %s; again in %.0f s", exc, delay)
        await asyncio.sleep(delay)
        delay = min(30.0, delay * 2)


async def serve_while(agent: CheckpointAgent, child: subprocess.Popen[Any] | int) -> int:
    """Serve ``agent`` until ``child`` (a Popen, or a pid this process forked) exits; its code."""
    task = asyncio.ensure_future(agent.run())
    loop = asyncio.get_running_loop()
    try:
        if isinstance(child, int):
            _, status = await loop.run_in_executor(None, os.waitpid, child, 0)
            return os.waitstatus_to_exitcode(status)
        return await loop.run_in_executor(None, child.wait)
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jupyter_gpushare.scheduler.features.checkpoint_agent",
        description="Run COMMAND and let the node scheduler checkpoint it (deep idle) "
        "through this process, which runs as COMMAND's user.",
    )
    parser.add_argument("--socket", required=True, help="the node scheduler's socket")
    parser.add_argument("--library", default="libcuda.so.1", help="the CUDA driver library")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from ...shim import shim_environment

    # COMMAND runs under the shim, as ``gpushare run`` would start it; this process does not.
    env = shim_environment(os.environ, socket=args.socket)
    child = subprocess.Popen(command, env=env)
    return asyncio.run(serve_while(CheckpointAgent(args.socket, args.library), child))


if __name__ == "__main__":
    sys.exit(main())
