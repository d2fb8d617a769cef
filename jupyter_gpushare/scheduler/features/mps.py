"""MPS mode: one NVIDIA MPS control daemon per GPU, owned by the scheduler.

Kernels admitted side by side share a GPU by time-slicing unless they run as clients of one MPS
server, whose kernels really run concurrently. In MPS mode (``c.GPUShareScheduler.mps = True``)
the scheduler starts ``nvidia-cuda-mps-control -d`` once per GPU, each with its own pipe and log
directories under the scheduler's runtime directory and ``CUDA_VISIBLE_DEVICES`` naming that GPU
alone, so every daemon (and the MPS server it spawns) sees exactly one device. A kernel becomes a
client by having that daemon's ``CUDA_MPS_PIPE_DIRECTORY`` in its environment before CUDA
initialises; the provisioner asks the scheduler for that environment at launch
(:meth:`MPSManager.client_env`, the ``mps_env`` control action), which also carries the kernel's
compute share (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) and its hard memory limit
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``).

Quitting safely. NVIDIA's MPS documentation warns that a client that ends with work still on the
GPU (SIGKILL in the middle of a kernel) can leave the MPS server and its other clients in an
undefined state; a client must synchronise before it exits, or be removed with
``terminate_client <server PID> <client PID>`` before it is killed. The shim synchronises at exit
and on fatal signals; for SIGKILL, which nothing in the process can catch, the provisioner asks the
scheduler to ``terminate_client`` first (:meth:`MPSManager.terminate_process`, the
``mps_terminate`` control action). The scheduler does it, not the provisioner, because it owns the
daemon (its pipe directory, its binary, its uid) and checks with ``SO_PEERCRED`` that the asking
peer owns the process.

Every command goes through an asyncio subprocess (``nvidia-cuda-mps-control`` with the command
on stdin, the documented ``echo CMD | nvidia-cuda-mps-control``), never blocking the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CONTROL_BINARY",
    "MPSDaemon",
    "MPSError",
    "MPSManager",
    "find_control_binary",
    "pinned_limit",
    "thread_percentage",
]

CONTROL_BINARY = "nvidia-cuda-mps-control"
#: Where driver containers and packages put the binary when it is not on PATH.
SEARCH_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin")
#: The control daemon writes its pid here, in its pipe directory (NVIDIA's MPS documentation).
PID_FILE = "nvidia-cuda-mps-control.pid"

_INT = re.compile(r"^\s*(\d+)\s*$")
_CUDA_STATUS = re.compile(r"\b(CUDA_(?:SUCCESS|ERROR_[A-Z_]+))\b")


class MPSError(RuntimeError):
    """MPS mode cannot do what was asked (no binary, a daemon that does not start, ...)."""


def find_control_binary(explicit: str = "", path: str | None = None) -> str | None:
    """The ``nvidia-cuda-mps-control`` to use: ``explicit`` when given (a path or a name on PATH),
    else the one on PATH, else one in :data:`SEARCH_DIRS`; None when there is none."""
    if explicit:
        if os.sep in explicit:
            return explicit if os.access(explicit, os.X_OK) else None
        return shutil.which(explicit, path=path)
    found = shutil.which(CONTROL_BINARY, path=path)
    if found:
        return found
    for directory in SEARCH_DIRS:
        candidate = os.path.join(directory, CONTROL_BINARY)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def thread_percentage(
    weight: float, default_percentage: float, compute_share: float | None = None
) -> int | None:
    """A client's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, or None for no limit.

    An explicit ``compute_share`` (percent of the GPU's SMs, 1-100) wins. Otherwise the share
    follows the fair-share weight: ``default_percentage * weight``, so with the default of 100 a
    weight-1 kernel may use the whole GPU (MPS still runs it beside the others) and a weight-0.5
    kernel half of it. The value is fixed when the kernel's CUDA context is made (MPS reads it
    then), so it cannot follow the number of kernels that come and go; it is a cap, not a
    reservation.
    """
    if compute_share is not None and compute_share > 0:
        share = compute_share
    else:
        share = default_percentage * weight
    if not share > 0:  # NaN too
        raise ValueError(f"compute share must be positive, got {share!r}")
    pct = max(1, math.ceil(min(share, 100.0) - 1e-9))
    # 100 needs no variable, unless the daemon's default is lower (a client without the
    # variable gets that default).
    return None if pct >= 100 and default_percentage >= 100 and not compute_share else pct


def pinned_limit(quota_bytes: int, ordinal: int = 0) -> str | None:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for a quota: ``"<ordinal>=<MiB>M"``, or None without
    a quota.

    The ordinal is the device as the client sees it: each daemon exposes one GPU, so it is 0. The
    quota is rounded *up* to whole MiB so the shim's own quota check (with its clear message)
    trips first; MPS's limit is the hard backstop behind it.
    """
    if quota_bytes <= 0:
        return None
    return f"{ordinal}={-(-quota_bytes // (1 << 20))}M"


@dataclass
class MPSDaemon:
    """One control daemon: the GPU it serves and its directories."""

    device: str  # the GPU's UUID (or an index) as CUDA_VISIBLE_DEVICES takes it
    pipe_dir: str
    log_dir: str
    pid: int | None = None
    started_at: float = 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "pipe_dir": self.pipe_dir,
            "log_dir": self.log_dir,
            "pid": self.pid,
        }


@dataclass
class CommandResult:
    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "returncode": self.returncode,
            "stdout": self.stdout[-2000:],
            "stderr": self.stderr[-2000:],
            "seconds": round(self.seconds, 4),
            "timed_out": self.timed_out,
        }


def _pids(text: str) -> list[int]:
    """PIDs of a ``get_server_list``/``get_client_list`` answer (one per line)."""
    return [int(m.group(1)) for line in text.splitlines() if (m := _INT.match(line))]


@dataclass
class MPSManager:
    """Starts, drives and stops the MPS control daemons of the scheduler's GPUs."""

    runtime_dir: str
    binary: str = ""
    default_percentage: float = 100.0
    command_timeout: float = 10.0
    terminate_timeout: float = 30.0
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("gpushare.mps"))
    daemons: dict[str, MPSDaemon] = field(default_factory=dict)

    # -- lifecycle ------------------------------------------------------------------------------

    def resolve_binary(self) -> str:
        found = find_control_binary(self.binary)
        if found is None:
            where = self.binary or f"{CONTROL_BINARY} (PATH, {', '.join(SEARCH_DIRS)})"
            raise MPSError(
                f"MPS mode is on but {where} was not found: install the NVIDIA driver's "
                "compute utilities, set GPUShareScheduler.mps_control_binary, or turn MPS off"
            )
        self.binary = found
        return found

    async def start(self, devices: Iterable[str]) -> None:
        """Start one daemon per device (UUIDs or indices); all or none."""
        self.resolve_binary()
        devices = list(devices)
        if not devices:
            raise MPSError(
                "MPS mode needs the GPUs to be known at start: enable NVML discovery or set "
                "GPUShareScheduler.mps_devices"
            )
        try:
            for index, device in enumerate(devices):
                await self.start_daemon(device, index)
        except BaseException:
            await self.stop()
            raise

    def _dirs(self, index: int) -> tuple[str, str]:
        base = os.path.join(self.runtime_dir, f"mps-{index}")
        return os.path.join(base, "pipe"), os.path.join(base, "log")

    def daemon_env(self, daemon: MPSDaemon) -> dict[str, str]:
        env = dict(os.environ)
        # The daemon and the MPS server it spawns see this GPU alone.
        env["CUDA_VISIBLE_DEVICES"] = daemon.device
        env["CUDA_MPS_PIPE_DIRECTORY"] = daemon.pipe_dir
        env["CUDA_MPS_LOG_DIRECTORY"] = daemon.log_dir
        # The daemon must never run under the shim (nor inherit a client's MPS settings).
        env.pop("LD_PRELOAD", None)
        for key in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
            env.pop(key, None)
        return env

    async def start_daemon(self, device: str, index: int) -> MPSDaemon:
        if device in self.daemons:
            return self.daemons[device]
        pipe_dir, log_dir = self._dirs(index)
        sock_max = len(os.fsencode(os.path.join(pipe_dir, "control_privileged")))
        if sock_max > 100:
            raise MPSError(f"the MPS pipe directory {pipe_dir} is too long for Unix sockets")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _make_dirs, pipe_dir, log_dir)
        daemon = MPSDaemon(device, pipe_dir, log_dir)
        stale = await loop.run_in_executor(None, _read_text, os.path.join(pipe_dir, PID_FILE))
        if (
            stale
            and stale.strip().isdigit()
            and await loop.run_in_executor(None, _alive, int(stale.strip()))
        ):
            # A daemon left by a scheduler that died: it is ours (our directory), and a second
            # `-d` on the same pipes would fail. Quit it and start afresh.
            self.log.warning("MPS %s: quitting the daemon left running (pid %s)", device, stale)
            daemon.pid = int(stale.strip())
            await self.control(daemon, "quit")
            if not await self._wait_gone(daemon.pid, 5.0):
                await self._kill_daemon(daemon)
            daemon.pid = None
        # `-d` forks the daemon and returns. The daemon may keep the fds it inherited, so its
        # output goes to a file (a pipe would not reach EOF while the daemon lives).
        err_path = os.path.join(log_dir, "daemon-start.err")
        err_file = await loop.run_in_executor(None, open, err_path, "wb")
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary,
                "-d",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=err_file,
                stderr=err_file,
                env=self.daemon_env(daemon),
            )
        finally:
            err_file.close()
        try:
            await asyncio.wait_for(proc.wait(), self.command_timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise MPSError(
                f"{self.binary} -d did not return within {self.command_timeout}s"
            ) from None
        if proc.returncode != 0:
            said = (await loop.run_in_executor(None, _read_text, err_path) or "").strip()
            tail = await loop.run_in_executor(None, self._log_tail, daemon)
            raise MPSError(
                f"the MPS control daemon for {device} did not start (exit {proc.returncode}): "
                f"{said}{tail}"
            )
        daemon.pid = await self._wait_pid(daemon)
        daemon.started_at = time.monotonic()
        self.daemons[device] = daemon
        # The daemon answers once its control pipe is up; a failure here means it died.
        probe = await self.control(daemon, "get_server_list")
        deadline = time.monotonic() + self.command_timeout
        while (
            not probe.ok
            and time.monotonic() < deadline
            and await loop.run_in_executor(None, _alive_or_unknown, daemon.pid)
        ):
            await asyncio.sleep(0.1)
            probe = await self.control(daemon, "get_server_list")
        if not probe.ok:
            self.daemons.pop(device, None)
            await self._kill_daemon(daemon)
            tail = await loop.run_in_executor(None, self._log_tail, daemon)
            raise MPSError(
                f"the MPS control daemon for {device} does not answer: "
                f"{(probe.stderr or probe.stdout).strip()}{tail}"
            )
        if self.default_percentage < 100:
            pct = max(1, math.ceil(self.default_percentage))
            res = await self.control(daemon, f"set_default_active_thread_percentage {pct}")
            if not res.ok:
                self.log.warning(
                    "MPS %s: set_default_active_thread_percentage %d failed: %s",
                    device,
                    pct,
                    (res.stderr or res.stdout).strip(),
                )
        self.log.info(
            "MPS control daemon for %s started (pid %s, pipes %s)", device, daemon.pid, pipe_dir
        )
        return daemon

    async def _wait_pid(self, daemon: MPSDaemon, timeout: float = 5.0) -> int | None:
        path = os.path.join(daemon.pipe_dir, PID_FILE)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = await loop.run_in_executor(None, _read_text, path)
            if text and text.strip().isdigit():
                return int(text.strip())
            await asyncio.sleep(0.05)
        self.log.warning("MPS %s: no %s in %s", daemon.device, PID_FILE, daemon.pipe_dir)
        return None

    def _log_tail(self, daemon: MPSDaemon) -> str:
        text = _read_text(os.path.join(daemon.log_dir, "control.log")) or ""
        tail = "\n".join(text.strip().splitlines()[-5:])
        return f"\ncontrol.log:\n{tail}" if tail else ""

    async def stop(self) -> None:
        """``quit`` every daemon (it stops its MPS servers), then make sure each is gone."""
        daemons, self.daemons = list(self.daemons.values()), {}
        for daemon in daemons:
            res = await self.control(daemon, "quit")
            if not res.ok:
                self.log.warning(
                    "MPS %s: quit failed: %s", daemon.device, (res.stderr or res.stdout).strip()
                )
            if not await self._wait_gone(daemon.pid, 5.0):
                await self._kill_daemon(daemon)
            self.log.info("MPS control daemon for %s stopped", daemon.device)

    async def _kill_daemon(self, daemon: MPSDaemon) -> None:
        if daemon.pid is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(daemon.pid, sig)
            if await self._wait_gone(daemon.pid, 2.0):
                return

    @staticmethod
    async def _wait_gone(pid: int | None, timeout: float) -> bool:
        if pid is None:
            return True
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not await loop.run_in_executor(None, _alive, pid):
                return True
            await asyncio.sleep(0.05)
        return not await loop.run_in_executor(None, _alive, pid)

    # -- commands -------------------------------------------------------------------------------

    async def control(
        self, daemon: MPSDaemon, command: str, timeout: float | None = None
    ) -> CommandResult:
        """Run one control command (``echo COMMAND | nvidia-cuda-mps-control``)."""
        timeout = self.command_timeout if timeout is None else timeout
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.daemon_env(daemon),
            )
        except OSError as exc:
            return CommandResult(command, 127, "", str(exc), time.monotonic() - t0)
        try:
            out, err = await asyncio.wait_for(proc.communicate((command + "\n").encode()), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await proc.wait()
            return CommandResult(command, -9, "", "timed out", time.monotonic() - t0, True)
        return CommandResult(
            command,
            proc.returncode if proc.returncode is not None else -1,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            time.monotonic() - t0,
        )

    def daemon_for(self, device: str | None) -> MPSDaemon:
        if not self.daemons:
            raise MPSError("no MPS control daemon is running")
        if device is None:
            return next(iter(self.daemons.values()))
        daemon = self.daemons.get(device)
        if daemon is None:
            for key, value in self.daemons.items():
                if key.lower() == device.lower():
                    return value
            raise MPSError(f"no MPS control daemon for device {device!r}")
        return daemon

    async def server_pids(self, daemon: MPSDaemon) -> list[int]:
        res = await self.control(daemon, "get_server_list")
        return _pids(res.stdout) if res.ok else []

    async def client_pids(self, daemon: MPSDaemon, server_pid: int) -> list[int]:
        res = await self.control(daemon, f"get_client_list {server_pid}")
        return _pids(res.stdout) if res.ok else []

    async def clients(self) -> list[tuple[MPSDaemon, int, int]]:
        """Every (daemon, server pid, client pid) there is now."""
        found = []
        for daemon in list(self.daemons.values()):
            for server in await self.server_pids(daemon):
                for client in await self.client_pids(daemon, server):
                    found.append((daemon, server, client))
        return found

    async def terminate_client(
        self, daemon: MPSDaemon, server_pid: int, client_pid: int
    ) -> dict[str, Any]:
        """``terminate_client <server PID> <client PID>``: the MPS server ends the client's GPU
        work and releases its resources; the process itself keeps running (kill it next)."""
        res = await self.control(
            daemon, f"terminate_client {server_pid} {client_pid}", self.terminate_timeout
        )
        text = res.stdout + res.stderr
        status = _CUDA_STATUS.search(text)
        ok = res.ok and "error" not in text.lower() and "fail" not in text.lower()
        if status is not None and status.group(1) != "CUDA_SUCCESS":
            ok = False
        out = {"server": server_pid, "client": client_pid, "ok": ok, **res.as_dict()}
        log = self.log.info if ok else self.log.warning
        log(
            "MPS %s: terminate_client %d %d -> %s in %.1f ms (%s)",
            daemon.device,
            server_pid,
            client_pid,
            "ok" if ok else "FAILED",
            res.seconds * 1000,
            text.strip()[:200],
        )
        return out

    async def terminate_process(self, pid: int, tree: bool = True) -> list[dict[str, Any]]:
        """``terminate_client`` for ``pid`` and, with ``tree``, every MPS client descended from it
        (a kernel's subprocesses inherit its MPS environment and are clients too)."""
        results = []
        loop = asyncio.get_running_loop()
        for daemon, server, client in await self.clients():
            if client == pid or (tree and await loop.run_in_executor(None, _descends, client, pid)):
                results.append(await self.terminate_client(daemon, server, client))
        return results

    # -- clients --------------------------------------------------------------------------------

    def client_env(
        self,
        device: str | None = None,
        *,
        weight: float = 1.0,
        compute_share: float | None = None,
        quota_bytes: int = 0,
    ) -> dict[str, Any]:
        """What a kernel's environment needs to run as a client of ``device``'s MPS server.

        ``env`` is to be set; ``unset`` lists variables to remove: ``CUDA_VISIBLE_DEVICES`` of
        the kernel would be read relative to the one device its MPS server sees, so an inherited
        ``1`` or a UUID would hide it.
        """
        daemon = self.daemon_for(device)
        env = {"CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir}
        pct = thread_percentage(weight, self.default_percentage, compute_share)
        if pct is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
        limit = pinned_limit(quota_bytes)
        if limit is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = limit
        return {"device": daemon.device, "env": env, "unset": ["CUDA_VISIBLE_DEVICES"]}

    def describe(self) -> dict[str, Any]:
        return {
            "binary": self.binary,
            "default_active_thread_percentage": self.default_percentage,
            "daemons": [d.describe() for d in self.daemons.values()],
        }


# ---- blocking helpers (run in an executor) ------------------------------------------------------


def _make_dirs(*dirs: str) -> None:
    for d in dirs:
        os.makedirs(d, mode=0o755, exist_ok=True)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child not yet reaped) is gone for every purpose here.
    stat = _read_text(f"/proc/{pid}/stat")
    if stat:
        fields = stat.rsplit(")", 1)[-1].split()
        if fields and fields[0] == "Z":
            return False
    return True


def _alive_or_unknown(pid: int | None) -> bool:
    return pid is None or _alive(pid)


def _parent(pid: int) -> int | None:
    stat = _read_text(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def _descends(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        parent = _parent(pid)
        if parent is None:
            return False
        if parent == ancestor:
            return True
        pid = parent
        seen += 1
    return False


def process_uid(pid: int) -> int | None:
    """The real uid of a process (from /proc), or None when it is gone."""
    text = _read_text(f"/proc/{pid}/status")
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None
