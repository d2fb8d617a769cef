"""Node labels for placing pods by one GPU's memory, through Node Feature Discovery's local
feature files (no Kubernetes API right needed).

Kubernetes counts a node's units of ``gpushare.io/gpu-memory``, not each GPU's, so a pod of 40
units can land on a node of two 24-unit GPUs and fail admission there (a pod's units come from one
GPU). The plugin writes, into NFD's ``features.d`` directory on the node (a hostPath), a file
that NFD's worker turns into node labels::

    gpushare-gpu-memory-largest-gpu=80   # units of the node's largest GPU pool
    gpushare-gpu-count=2

NFD prefixes names without a namespace with its own, ``feature.node.kubernetes.io/``, which every
NFD version accepts; a profile that asks for N units adds a node affinity
``feature.node.kubernetes.io/gpushare-gpu-memory-largest-gpu Gt N-1``
(docs/operators/multi-gpu.md). The label follows the GPUs' pools, not what pods hold:
it keeps pods off nodes where they can never fit, and the plugin still refuses a split of a
node whose GPUs are too full at the moment.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from typing import Protocol

__all__ = [
    "FILE_NAME",
    "GPU_COUNT",
    "LABEL_PREFIX",
    "LARGEST_GPU",
    "feature_text",
    "write_features",
]

FILE_NAME = "gpushare"
#: NFD's namespace for names that bring none: the labels are LABEL_PREFIX + the names below.
LABEL_PREFIX = "feature.node.kubernetes.io/"
LARGEST_GPU = "gpushare-gpu-memory-largest-gpu"
GPU_COUNT = "gpushare-gpu-count"


class _Pool(Protocol):
    pool_bytes: int


def feature_text(pools: Iterable[_Pool], unit: int) -> str:
    """NFD's local feature file for these GPU pools (units of ``unit`` bytes)."""
    pools = list(pools)
    largest = max((p.pool_bytes // unit for p in pools), default=0)
    return f"{LARGEST_GPU}={largest}\n{GPU_COUNT}={len(pools)}\n"


def write_features(directory: str, text: str) -> bool:
    """Replace ``directory``/gpushare with ``text`` (atomically: NFD may read it any time);
    False when it already says that."""
    path = os.path.join(directory, FILE_NAME)
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{FILE_NAME}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True
