"""Kernels that outlive their Jupyter server, and the new server that adopts them.

With ``c.GPUShareProvisioner.survive_server_restart = True`` the provisioner starts each kernel
*independent* of its server (no ``JPY_PARENT_PID``, so ipykernel's parent poller does not end
it when the server dies) and keeps a record of it in the server's runtime directory:
``gpushare-kernel-<kernel id>.json`` (written atomically at launch and at each restart, removed
when the kernel is shut down). jupyter_client's own connection file ``kernel-<id>.json`` stays
next to it. When a server starts (:func:`adopt_kernels`, called by the server extension), it
reads the records of servers that are no longer running and, for each kernel whose process is
still the same process (pid and start time):

* with a node scheduler: adopts it (unless the scheduler lists a *different* process under the
  kernel's id) into the server's MappingKernelManager, under the same kernel id, so that
  ``/api/kernels`` lists it and notebooks reconnect to it; the scheduler's client (same id, same
  memory, same grant) is untouched;
* with an embedded scheduler: the kernel's scheduler died with the old server, so the kernel is
  asked to end (SIGTERM to its process group) rather than left running outside any scheduler.

Records of kernels whose process is gone are removed, with their connection files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "RECORD_PREFIX",
    "AdoptedProcess",
    "adopt_kernels",
    "process_start_time",
    "remove_record",
    "write_record",
]

RECORD_PREFIX = "gpushare-kernel-"


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22),
    which tells a process from a later one that got the same pid; None when unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie runs nothing
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int | None, start_time: int | None) -> bool:
    """Whether ``pid`` still runs the process that was recorded with ``start_time``."""
    if not pid or pid <= 0:
        return False
    now = process_start_time(pid)
    if now is None:
        return False
    return start_time is None or now == start_time


class AdoptedProcess:
    """Stands in for the :class:`subprocess.Popen` of a kernel this server did not start, so
    that LocalProvisioner's poll/wait/signal/kill work on it. It cannot reap the process (not
    our child): it watches the pid and its start time instead."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, start_time: int | None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not same_process(self.pid, self.start_time):
            self.returncode = -1  # unknown: the exit status went to the process's new parent
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        # Only called by LocalProvisioner.wait once poll() says the process has ended.
        return self.returncode if self.returncode is not None else -1

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- records -----------------------------------------------------------------------------------


def record_path(runtime_dir: str, kernel_id: str) -> Path:
    return Path(runtime_dir) / f"{RECORD_PREFIX}{kernel_id}.json"


def _write_atomic(path: Path, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


async def write_record(runtime_dir: str, kernel_id: str, doc: dict[str, Any]) -> None:
    """Write (atomically, in an executor) the record of a kernel that may outlive its server."""
    doc = {
        **doc,
        "kernel_id": kernel_id,
        "server_pid": os.getpid(),
        "server_start_time": process_start_time(os.getpid()),
    }
    await asyncio.to_thread(_write_atomic, record_path(runtime_dir, kernel_id), doc)


async def remove_record(runtime_dir: str, kernel_id: str) -> None:
    def remove() -> None:
        with contextlib.suppress(FileNotFoundError):
            record_path(runtime_dir, kernel_id).unlink()

    await asyncio.to_thread(remove)


def _read_records(runtime_dir: str) -> list[tuple[Path, dict[str, Any] | None]]:
    found: list[tuple[Path, dict[str, Any] | None]] = []
    for path in sorted(Path(runtime_dir).glob(f"{RECORD_PREFIX}*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = None
        found.append((path, doc if isinstance(doc, dict) else None))
    return found


def _unlink(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


# -- adoption ----------------------------------------------------------------------------------


async def adopt_kernels(
    kernel_manager: Any,
    runtime_dir: str,
    *,
    embedded: bool,
    scheduler_status: Any,
    log: logging.Logger | logging.LoggerAdapter[Any],
    session_manager: Any = None,
) -> dict[str, list[str]]:
    """Find the kernels that outlived earlier servers of ``runtime_dir`` and adopt (node
    scheduler) or end (embedded scheduler) them; remove the records of the gone. Returns the
    kernel ids by outcome: ``adopted``, ``ended``, ``gone``, ``skipped``."""
    outcome: dict[str, list[str]] = {"adopted": [], "ended": [], "gone": [], "skipped": []}
    if not runtime_dir or not os.path.isdir(runtime_dir):
        return outcome
    records = await asyncio.to_thread(_read_records, runtime_dir)
    status: dict[str, Any] | None = None
    for path, doc in records:
        if doc is None:
            log.warning("gpushare: unreadable kernel record %s: removed", path)
            await asyncio.to_thread(_unlink, path)
            continue
        kid = str(doc.get("kernel_id", ""))
        server_pid = doc.get("server_pid")
        if server_pid == os.getpid() or same_process(server_pid, doc.get("server_start_time")):
            continue  # a kernel of this server, or of another server that still runs
        conn_file = Path(runtime_dir) / f"kernel-{kid}.json"
        pid = (doc.get("provisioner_info") or {}).get("pid")
        if not same_process(pid, doc.get("start_time")) or kid in kernel_manager:
            log.info("gpushare: kernel %s of a former server is gone: record removed", kid)
            await asyncio.to_thread(_unlink, path, conn_file)
            outcome["gone"].append(kid)
            continue
        if embedded:
            # Its scheduler was the old server's: it cannot reach ours. End it (the shim says
            # goodbye on SIGTERM) rather than leave GPU memory outside any scheduler.
            pgid = (doc.get("provisioner_info") or {}).get("pgid")
            with contextlib.suppress(OSError):
                if pgid:
                    os.killpg(pgid, signal.SIGTERM)
                else:
                    os.kill(pid, signal.SIGTERM)
            log.warning(
                "gpushare: kernel %s (pid %s) outlived its server but the scheduler was embedded"
                " in it: asked to end (SIGTERM)",
                kid,
                pid,
            )
            await asyncio.to_thread(_unlink, path, conn_file)
            outcome["ended"].append(kid)
            continue
        if status is None:
            try:
                status = await scheduler_status()
            except Exception as exc:
                log.warning("gpushare: scheduler status for adoption: %s", exc)
                status = {}
        other = _client_pid(status, kid)
        if other is not None and other != pid:
            log.warning(
                "gpushare: not adopting kernel %s (pid %s): the scheduler lists pid %s as it",
                kid,
                pid,
                other,
            )
            outcome["skipped"].append(kid)
            continue
        try:
            await _adopt(kernel_manager, doc, str(conn_file), log)
        except Exception as exc:
            log.error("gpushare: cannot adopt kernel %s (pid %s): %s", kid, pid, exc)
            outcome["skipped"].append(kid)
            continue
        outcome["adopted"].append(kid)
        await _restore_session(session_manager, kid, doc.get("notebook"), log)
        log.info(
            "gpushare: adopted kernel %s (pid %s, %s) of a former server (pid %s)%s",
            kid,
            pid,
            doc.get("kernel_name"),
            server_pid,
            "" if other is None else "; the scheduler still has its client",
        )
    return outcome


def _client_pid(status: dict[str, Any], kernel_id: str) -> int | None:
    for device in status.get("devices", []) or []:
        for client in device.get("clients", []) or []:
            if client.get("id") == kernel_id:
                return int(client.get("pid") or 0)
    return None


async def _restore_session(session_manager: Any, kid: str, notebook: Any, log: Any) -> None:
    """Give the adopted kernel its notebook's session again (the sessions of a server live in
    its memory), under a new session id: reopening the notebook then gets this kernel
    (POST /api/sessions returns the existing session of a path)."""
    if session_manager is None or not isinstance(notebook, str) or not notebook.endswith(".ipynb"):
        return
    try:
        if await session_manager.session_exists(path=notebook):
            return
        await session_manager.save_session(
            session_manager.new_session_id(),
            path=notebook,
            name=os.path.basename(notebook),
            type="notebook",
            kernel_id=kid,
        )
    except Exception as exc:
        log.warning("gpushare: no session for adopted kernel %s (%s): %s", kid, notebook, exc)


async def _adopt(mkm: Any, doc: dict[str, Any], conn_file: str, log: Any) -> None:
    """Put a running kernel into jupyter_server's MappingKernelManager as its start_kernel
    would have (jupyter_server has no public API for this)."""
    from jupyter_client.provisioning import KernelProvisionerFactory
    from jupyter_server._tz import utcnow

    kid = str(doc["kernel_id"])
    kwargs: dict[str, Any] = {}
    if getattr(mkm, "kernel_spec_manager", None) is not None:
        kwargs["kernel_spec_manager"] = mkm.kernel_spec_manager
    km = mkm.kernel_manager_factory(
        connection_file=conn_file,
        parent=mkm,
        log=mkm.log,
        kernel_name=str(doc.get("kernel_name") or ""),
        **kwargs,
    )
    km.kernel_id = kid
    await asyncio.to_thread(km.load_connection_file, conn_file)
    km._connection_file_written = True  # ours now: removed at shutdown, as for our own kernels
    km.provisioner = KernelProvisionerFactory.instance(parent=mkm).create_provisioner_instance(
        kid, km.kernel_spec, parent=km
    )
    info = dict(doc.get("provisioner_info") or {})
    info["kernel_id"] = kid
    info["connection_info"] = km.get_connection_info()
    await km.provisioner.load_provisioner_info(info)
    if not km.provisioner.has_process:
        raise RuntimeError("its provisioner cannot take over a running process")
    # A restart (by the user, or the restarter after a crash) starts it where it ran.
    km._launch_args = {"cwd": doc["cwd"]} if doc.get("cwd") else {}
    km._attempted_start = True
    if not km.ready.done():
        km.ready.set_result(None)
    km.start_restarter()
    km._connect_control_socket()

    mkm._kernels[kid] = km
    mkm._kernel_connections[kid] = 0
    km.execution_state = "idle"
    km.reason = ""
    km.last_activity = utcnow()
    await mkm._finish_kernel_start(kid)
    with contextlib.suppress(Exception):
        from jupyter_server.prometheus.metrics import KERNEL_CURRENTLY_RUNNING_TOTAL

        KERNEL_CURRENTLY_RUNNING_TOTAL.labels(type=km.kernel_name).inc()
    if not getattr(mkm, "_initialized_culler", True):
        mkm.initialize_culler()
