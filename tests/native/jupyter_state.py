"""What the Jupyter server extension tells the scheduler, for the native tests' programs."""

from __future__ import annotations

from typing import Any

from jupyter_gpushare.scheduler_client import SchedulerClient


def kernel_state(harness: Any, client: str, state: str) -> None:
    """What the Jupyter server extension says when a cell starts (busy) or ends (idle)."""
    scheduler = SchedulerClient(str(harness.socket_path))
    scheduler.control_sync("kernel_state", client=client, state=state)
