"""jupyter-gpushare: many Jupyter kernels share one GPU.

Kernels that fit the GPU's memory pool run side by side; kernels that don't take turns in time
quanta; a kernel whose cell has finished hands the GPU over at once.
"""

from ._version import __version__

__all__ = ["__version__"]
