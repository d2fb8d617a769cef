"""The extension's kernel watcher (serverextension/kernel_watch.py) on iopub status messages
signed and framed as a kernel sends them, without a kernel: the paths a real kernel reaches only
by a race, such as a cell whose ``busy`` came before the subscription was connected."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jupyter_client.session import Session

from jupyter_gpushare.serverextension.kernel_watch import KernelWatcher, _Watch

KERNEL = "k-1"


class Kernel:
    """The kernel's side: status messages on iopub with the request as the parent."""

    def __init__(self) -> None:
        self.session = Session(key=b"secret", signature_scheme="hmac-sha256")

    def status(self, state: str, parent: dict[str, Any]) -> list[bytes]:
        msg = self.session.msg("status", {"execution_state": state}, parent=parent)
        return self.session.serialize(msg, ident=[b"kernel.k-1.status"])

    def request(self, msg_type: str = "execute_request") -> dict[str, Any]:
        return self.session.msg(msg_type, {})


async def watching(kernel: Kernel) -> tuple[KernelWatcher, _Watch, list[tuple[str, str]]]:
    sent: list[tuple[str, str]] = []

    async def send_state(kernel_id: str, state: str) -> None:
        sent.append((kernel_id, state))

    class Manager:
        untracked_message_types: list[str] = []

        def list_kernel_ids(self) -> list[str]:
            return []

    watcher = KernelWatcher(Manager(), None, send_state, log=logging.getLogger("test"))
    watcher.start()
    # The watcher's own session, with the kernel's key (as KernelWatcher.watch makes it).
    session = Session(key=kernel.session.key, signature_scheme="hmac-sha256")
    return watcher, _Watch(KERNEL, stream=None, session=session, manager=None), sent  # type: ignore[arg-type]


async def settle(watcher: KernelWatcher) -> None:
    for _ in range(10):
        await asyncio.sleep(0)
    await watcher.stop()


async def test_a_cell_whose_busy_was_missed_still_says_idle_once() -> None:
    """ZMQ's slow joiner: a cell run just after the kernel started publishes its ``busy`` before
    the watcher's subscription is connected. Its ``idle`` must still reach the scheduler (that
    is what hands the GPU over at once), once; later cells are tracked as usual."""
    kernel = Kernel()
    watcher, w, sent = await watching(kernel)
    first = kernel.request()
    watcher._on_iopub(w, kernel.status("idle", first))  # its busy never arrived
    # Another unmatched idle (a request from before, its busy lost too) says nothing new.
    watcher._on_iopub(w, kernel.status("idle", kernel.request()))
    second = kernel.request()
    watcher._on_iopub(w, kernel.status("busy", second))
    watcher._on_iopub(w, kernel.status("idle", second))
    await settle(watcher)
    assert sent == [(KERNEL, "idle"), (KERNEL, "busy"), (KERNEL, "idle")]


async def test_requests_that_run_no_code_and_overlapping_requests() -> None:
    """A completion's busy/idle is no cell; a control request that ends inside a long cell
    does not end the cell."""
    kernel = Kernel()
    watcher, w, sent = await watching(kernel)
    cell, probe = kernel.request(), kernel.request("complete_request")
    watcher._on_iopub(w, kernel.status("busy", probe))
    watcher._on_iopub(w, kernel.status("idle", probe))
    watcher._on_iopub(w, kernel.status("busy", cell))
    inner = kernel.request("execute_request")
    watcher._on_iopub(w, kernel.status("busy", inner))
    watcher._on_iopub(w, kernel.status("idle", inner))
    watcher._on_iopub(w, kernel.status("idle", cell))
    await settle(watcher)
    assert sent == [(KERNEL, "busy"), (KERNEL, "idle")]
