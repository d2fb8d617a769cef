"""jupyter-gpushare: many Jupyter kernels share one GPU.

Kernels that fit the GPU's memory pool run side by side; kernels that don't take turns in time
quanta; a kernel whose cell has finished hands the GPU over at once.
"""

from typing import Any

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """The jupyter-server extension (``jupyter server extension enable jupyter_gpushare``)."""
    from .serverextension import _jupyter_server_extension_points as points

    return points()
