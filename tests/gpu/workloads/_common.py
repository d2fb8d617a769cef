"""Shared by the GPU workloads: report what the shim saw, as one JSON line on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any


def shim_status() -> dict[str, Any] | None:
    """The in-process shim's status, or None when this process runs without the shim."""
    try:
        from jupyter_gpushare.shim import read_status
    except ImportError:
        return None
    return read_status()


def emit(**fields: Any) -> None:
    fields["shim"] = shim_status()
    print(json.dumps(fields), flush=True)
    sys.stdout.flush()
