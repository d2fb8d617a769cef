"""The server extension lists this server's GPU-shared kernels that the scheduler does not list
(no GPU call yet, or no GPU at all), so the sidebar can show them in the magic's words; kernels
that do not run under gpushare and kernels the scheduler lists are left out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from jupyter_gpushare.provisioner import GPUShareProvisioner
from jupyter_gpushare.scheduler_view import NO_GPU
from jupyter_gpushare.serverextension.status import StatusBroadcaster, enrich


def _kernels(provisioners: dict[str, Any]) -> Any:
    managers = {
        kid: SimpleNamespace(
            kernel_name="python3-gpushare" if isinstance(p, GPUShareProvisioner) else "python3",
            execution_state="idle",
            provisioner=p,
        )
        for kid, p in provisioners.items()
    }
    return SimpleNamespace(list_kernel_ids=lambda: list(managers), get_kernel=managers.__getitem__)


class _Sessions:
    async def list_sessions(self) -> list[dict[str, Any]]:
        return [
            {
                "id": "s1",
                "path": "work/a.ipynb",
                "name": "a",
                "type": "notebook",
                "kernel": {"id": "ka"},
            }
        ]


def _enrich(doc: dict[str, Any], kernels: Any) -> dict[str, Any]:
    return asyncio.run(
        enrich(
            doc, kernel_manager=kernels, session_manager=_Sessions(), viewer="alice", admin=False
        )
    )


def _shared() -> GPUShareProvisioner:
    return GPUShareProvisioner.__new__(GPUShareProvisioner)


def test_shared_kernel_before_its_first_gpu_call_is_listed() -> None:
    kernels = _kernels({"ka": _shared(), "kb": _shared(), "plain": object()})
    device = {"uuid": "GPU-1", "clients": [{"id": "kb#123", "uid": 0, "state": "idle"}]}
    out = _enrich({"nvml": True, "devices": [device]}, kernels)
    assert out["unregistered"] == [
        {
            "kernel_id": "ka",
            "kernel_name": "python3-gpushare",
            "execution_state": "idle",
            "paths": ["work/a.ipynb"],
            "reason": "no-gpu-call",
            "text": "not registered yet (at its first GPU call); holds no GPU",
        }
    ]


def test_shared_kernel_without_a_gpu_says_so_in_the_magics_words() -> None:
    kernels = _kernels({"ka": _shared(), "plain": object()})
    out = _enrich({"nvml": "NVML disabled", "devices": []}, kernels)
    assert [(k["kernel_id"], k["reason"]) for k in out["unregistered"]] == [("ka", "no-gpu")]
    assert out["unregistered"][0]["text"] == NO_GPU


class _QuietBackend:
    """A scheduler whose document never changes (no kernel has made a GPU call)."""

    notifies = True

    def __init__(self) -> None:
        self.listeners: list[Any] = []

    async def ensure_started(self) -> None:
        return None

    def add_listener(self, listener: Any) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: Any) -> None:
        self.listeners.remove(listener)

    async def status(self) -> dict[str, Any]:
        return {"nvml": True, "devices": []}


def test_a_kernel_that_starts_is_pushed_though_the_scheduler_saw_nothing() -> None:
    """Subscribers get the document again when this server's kernels change (the watcher wakes
    the broadcaster on each kernel action): the enriched document lists a new GPU-shared kernel
    before its first GPU call, while the scheduler's own document stays the same."""
    kernels: list[str] = []

    async def story() -> int:
        pushes: list[Any] = []

        async def push(doc: Any, error: Any) -> None:
            pushes.append(doc)

        b = StatusBroadcaster(
            _QuietBackend(),  # type: ignore[arg-type]
            interval=0.01,
            refresh=3600,
            local_kernels=lambda: list(kernels),
        )
        b.start()
        b.subscribe("page", push)
        for _ in range(500):
            if pushes:
                break
            await asyncio.sleep(0.01)
        assert len(pushes) == 1
        kernels.append("ka")
        b.wake()
        for _ in range(500):
            if len(pushes) == 2:
                break
            await asyncio.sleep(0.01)
        await b.stop()
        return len(pushes)

    assert asyncio.run(story()) == 2
