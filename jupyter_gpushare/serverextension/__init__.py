"""The Jupyter server extension of jupyter-gpushare.

It runs (or connects to) the node's GPU scheduler, tells it when kernels start and finish cells
(from their iopub ``status`` messages), and serves a REST API and a websocket of status updates
under ``<base_url>gpushare/api/`` for the sidebar (docs/rest-api.yaml).

The submodules import jupyter_server; this ``__init__`` does not, so ``jupyter_gpushare``
stays cheap to import in kernels (the ``%gpushare`` magic).
"""

from __future__ import annotations

from typing import Any

__all__ = ["_jupyter_server_extension_points"]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .app import GPUShareExtension

    return [{"module": "jupyter_gpushare.serverextension.app", "app": GPUShareExtension}]
