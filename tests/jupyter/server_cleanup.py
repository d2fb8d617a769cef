"""pytest-jupyter's server cleanup after each test, bounded. server_helpers.py exports it in place
of pytest-jupyter's own ``jp_server_cleanup`` to the modules that import everything from there.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import os
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_server.serverapp import ServerApp

#: How long the server's cleanup after a test may take. It takes under a second here; once, on a
#: loaded host, it hung for four minutes until the test's timeout, and the ServerApp it left behind
#: failed four later tests in other files (an "incompatible sibling" singleton).
CLEANUP_LIMIT_S = 60.0


def _stacks(loop: asyncio.AbstractEventLoop) -> str:
    """Every asyncio task's stack and every thread's, for a cleanup that did not end."""
    out = io.StringIO()
    for task in asyncio.all_tasks(loop):
        task.print_stack(limit=12, file=out)
    with tempfile.TemporaryFile("w+") as threads:  # faulthandler writes to a real file
        faulthandler.dump_traceback(threads, all_threads=True)
        threads.seek(0)
        out.write(threads.read())
    return out.getvalue()


def _kill_kernels(app: Any) -> None:
    km = getattr(app, "kernel_manager", None)
    for kernel_id in list(km.list_kernel_ids()) if km is not None else []:
        process = getattr(getattr(km.get_kernel(kernel_id), "provisioner", None), "process", None)
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)


async def _cleanup_within(app: Any, limit: float) -> str | None:
    """Run the server's cleanup; past ``limit`` seconds, what every task and thread was doing."""
    cleanup = asyncio.ensure_future(app._cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=limit)
    if done:
        try:
            cleanup.result()
        except (RuntimeError, SystemExit) as exc:  # as pytest_jupyter's own fixture ignores them
            print("ignoring cleanup error", exc)
        return None
    stacks = _stacks(asyncio.get_running_loop())
    cleanup.cancel()
    _kill_kernels(app)
    await asyncio.wait({cleanup}, timeout=10)
    return stacks


@pytest.fixture(autouse=True)
def jp_server_cleanup(jp_asyncio_loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """pytest_jupyter's cleanup of the same name, bounded: a cleanup that hangs fails its own test
    with every task's and thread's stack, and the singleton is cleared for the tests after it."""
    yield
    app = ServerApp.instance()
    try:
        stuck = jp_asyncio_loop.run_until_complete(_cleanup_within(app, CLEANUP_LIMIT_S))
    finally:
        if hasattr(app, "kernel_manager"):
            app.kernel_manager.context.destroy()
        ServerApp.clear_instance()
    if stuck is not None:
        pytest.fail(f"the server's cleanup took over {CLEANUP_LIMIT_S:.0f} s:\n{stuck}")
