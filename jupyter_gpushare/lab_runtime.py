"""The runtime file that makes a Jupyter server's embedded scheduler findable from other shells.

A server that embeds the scheduler writes ``gpushare-lab-<pid>.json`` into its Jupyter runtime
directory (``jupyter --runtime-dir``), readable by its owner only, with the scheduler's socket;
it removes the file when it stops. ``gpushare status``, ``run``, ``release`` and ``evict`` read
it when neither ``--socket`` nor ``$GPUSHARE_SOCKET`` names a socket and no scheduler listens on
the default one (docs/jupyter.md, "The scheduler from a shell").
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from .scheduler.features.mps import _alive

__all__ = ["find_lab_schedulers", "remove_runtime_file", "write_runtime_file"]

PREFIX = "gpushare-lab-"


def write_runtime_file(runtime_dir: str, socket: str, url: str = "") -> Path:
    """Write this process's file (mode 0600) and return its path."""
    path = Path(runtime_dir) / f"{PREFIX}{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"socket": socket, "pid": os.getpid(), "url": url}, out)
    return path


def remove_runtime_file(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def find_lab_schedulers(runtime_dir: str | None = None) -> list[dict[str, Any]]:
    """The live embedded schedulers of this user's Jupyter servers, newest first. Files that
    others could have written (not this user's, or readable by others) are ignored."""
    if runtime_dir is None:
        from jupyter_core.paths import jupyter_runtime_dir

        runtime_dir = jupyter_runtime_dir()
    found = []
    for path in Path(runtime_dir).glob(f"{PREFIX}*.json"):
        try:
            st = path.lstat()
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.getuid()
                or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
            ):
                continue
            doc = json.loads(path.read_text())
            socket, pid = str(doc["socket"]), int(doc["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid) and os.path.exists(socket):
            found.append({**doc, "file": str(path), "mtime": st.st_mtime})
    return sorted(found, key=lambda d: d["mtime"], reverse=True)
