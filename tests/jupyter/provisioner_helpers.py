"""Helpers for the provisioner, kernelspec and magic tests: real ipykernel kernels started through
jupyter_client's AsyncKernelManager and the gpushare provisioner, running the real shim in front
of the stand-in driver (tests/conftest.py builds both), with a real scheduler subprocess.

A uniquely named module (not conftest) so that other test directories' helpers never collide;
tests/jupyter/conftest.py re-exports the fixtures.

Kernel cells drive the stand-in driver through ctypes (:data:`GPU_PRELUDE`): ``alloc(n)``,
``launch(us)`` (the stand-in's "sleep" kernel), ``sync()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

MiB = 1 << 20
GiB = 1 << 30
#: The shim's context estimate in the kernels (GPUSHARE_CONTEXT_BYTES), kept small and exact.
CONTEXT = 16 * MiB

#: Defines alloc / launch / sync in a kernel; the context is created and made current.
GPU_PRELUDE = r"""
import ctypes as _ct
_cu = _ct.CDLL("libcuda.so.1")
_cu.cuMemAlloc_v2.argtypes = [_ct.POINTER(_ct.c_uint64), _ct.c_size_t]
_cu.cuModuleGetFunction.argtypes = [_ct.POINTER(_ct.c_void_p), _ct.c_void_p, _ct.c_char_p]
_cu.cuLaunchKernel.argtypes = [_ct.c_void_p] + [_ct.c_uint] * 7 + [_ct.c_void_p] * 3
_cu.cuCtxSetCurrent.argtypes = [_ct.c_void_p]

def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUDA error {rc}")

_check(_cu.cuInit(0), "cuInit")
_dev = _ct.c_int()
_check(_cu.cuDeviceGet(_ct.byref(_dev), 0), "cuDeviceGet")
_ctx = _ct.c_void_p()
_check(_cu.cuDevicePrimaryCtxRetain(_ct.byref(_ctx), _dev), "cuDevicePrimaryCtxRetain")
_check(_cu.cuCtxSetCurrent(_ctx), "cuCtxSetCurrent")
_mod = _ct.c_void_p()
_check(_cu.cuModuleLoadData(_ct.byref(_mod), b"stand-in image"), "cuModuleLoadData")
_sleep_fn = _ct.c_void_p()
_check(_cu.cuModuleGetFunction(_ct.byref(_sleep_fn), _mod, b"sleep"), "cuModuleGetFunction")

def alloc(nbytes):
    ptr = _ct.c_uint64()
    rc = _cu.cuMemAlloc_v2(_ct.byref(ptr), nbytes)
    return rc, ptr.value

def launch(us=1000):
    arg = _ct.c_ulonglong(us)
    params = (_ct.c_void_p * 1)(_ct.cast(_ct.byref(arg), _ct.c_void_p))
    return _cu.cuLaunchKernel(_sleep_fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)

def sync():
    return _cu.cuCtxSynchronize()
"""


@dataclass
class Cell:
    """What a cell produced on iopub, and its execute_reply."""

    status: str = ""
    stdout: str = ""
    stderr: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)  # execute_result/display data
    error: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return "\n".join(str(r.get("text/plain", "")) for r in self.results)

    @property
    def html(self) -> str:
        return "\n".join(str(r.get("text/html", "")) for r in self.results)

    def describe(self) -> str:
        return (
            f"status: {self.status}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}\n"
            f"results: {self.results}\nerror: {self.error}"
        )

    def ok(self) -> Cell:
        assert self.status == "ok", self.describe()
        return self

    def json(self) -> Any:
        """The last stdout line as JSON."""
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        assert lines, self.describe()
        return json.loads(lines[-1])


async def execute(kc: Any, code: str, timeout: float = 60.0) -> Cell:
    """Run ``code`` in the kernel; collect its iopub output until the kernel is idle again."""
    start = time.monotonic()
    msg_id = kc.execute(code)
    cell = Cell()
    deadline = start + timeout
    idle = False
    while not idle:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"cell still running after {timeout}s:\n{code}\n{cell.describe()}")
        try:
            msg = await kc.get_iopub_msg(timeout=left)
        except Exception as exc:  # queue.Empty
            raise AssertionError(
                f"no output within {timeout}s:\n{code}\n{cell.describe()}"
            ) from exc
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                cell.stdout += content["text"]
            else:
                cell.stderr += content["text"]
        elif kind in ("execute_result", "display_data"):
            cell.results.append(content["data"])
        elif kind == "error":
            cell.error = content
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True
    reply = await kc.get_shell_msg(timeout=max(deadline - time.monotonic(), 5))
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = await kc.get_shell_msg(timeout=max(deadline - time.monotonic(), 5))
    cell.status = reply["content"]["status"]
    if cell.status == "error" and cell.error is None:
        cell.error = reply["content"]
    cell.seconds = time.monotonic() - start
    return cell


def write_kernelspec(
    kernels_dir: Path, name: str, config: dict[str, Any] | None = None, provisioner: bool = True
) -> Path:
    """A kernelspec starting this interpreter's ipykernel, through the gpushare provisioner."""
    spec: dict[str, Any] = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"{name} (test)",
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {},
    }
    if provisioner:
        spec["metadata"]["kernel_provisioner"] = {
            "provisioner_name": "gpushare-provisioner",
            "config": config or {},
        }
    directory = kernels_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kernel.json").write_text(json.dumps(spec, indent=1))
    return directory


class Kernels:
    """Starts kernels through the provisioner; shuts down every one at teardown."""

    def __init__(self, harness: Any, tmp: Path) -> None:
        self.harness = harness
        self.tmp = tmp
        self.kernels_dir = tmp / "kernels"
        self.kernels_dir.mkdir(parents=True, exist_ok=True)
        self.managers: list[AsyncKernelManager] = []
        self.clients: list[Any] = []
        self.workdir = tmp / "work"
        self.workdir.mkdir(exist_ok=True)

    def kernel_env(self, **extra: str) -> dict[str, str]:
        """The kernel's environment as the server would pass it, plus the stand-in driver."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
        env.pop("LD_PRELOAD", None)
        # ipykernel does not capture the process's fd 1/2 under pytest: the shim's own stderr
        # lines must reach the cell's stderr, as they do in a notebook.
        env.pop("PYTEST_CURRENT_TEST", None)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(self.harness.build.fake_dir), os.environ.get("LD_LIBRARY_PATH")])
        )
        env["GPUSHARE_CONTEXT_BYTES"] = str(CONTEXT)
        env["GPUSHARE_IDLE_SECONDS"] = "0"
        env["GPUSHARE_LOG"] = "warn"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")])
        )
        env.update(extra)
        return env

    async def start(
        self,
        config: dict[str, Any] | None = None,
        name: str = "gs-test",
        env: dict[str, str] | None = None,
        **start_kwargs: Any,
    ) -> tuple[AsyncKernelManager, Any]:
        write_kernelspec(self.kernels_dir, name, config)
        ksm = KernelSpecManager(kernel_dirs=[str(self.kernels_dir)], ensure_native_kernel=False)
        km = AsyncKernelManager(kernel_name=name, kernel_spec_manager=ksm)
        self.managers.append(km)
        start_kwargs.setdefault("cwd", str(self.workdir))
        await km.start_kernel(env=env if env is not None else self.kernel_env(), **start_kwargs)
        kc = km.client()
        self.clients.append(kc)
        kc.start_channels()
        await kc.wait_for_ready(timeout=120)
        return km, kc

    async def close(self) -> None:
        for kc in self.clients:
            with contextlib.suppress(Exception):
                kc.stop_channels()
        for km in self.managers:
            with contextlib.suppress(Exception):
                if await km.is_alive():
                    await km.shutdown_kernel(now=True)


def scheduler_clients(sched: Any) -> list[dict[str, Any]]:
    return [c for d in sched.status().get("devices", []) for c in d.get("clients", [])]


def wait_for(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


async def async_wait_for(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)


@pytest.fixture
def shim_library(native_build: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test build of libgpushare.so, as the provisioner (in this process) finds it."""
    shim = native_build.require_shim()
    monkeypatch.setenv("GPUSHARE_LIBRARY", str(shim))
    yield shim


@pytest.fixture
async def kernels(
    harness: Any, shim_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Kernels]:
    """Kernels under the provisioner. $GPUSHARE_SOCKET of this (server) process is the harness's
    socket, as the server extension sets it for an embedded scheduler."""
    monkeypatch.setenv("GPUSHARE_SOCKET", str(harness.socket_path))
    k = Kernels(harness, tmp_path)
    try:
        yield k
    finally:
        await k.close()
