"""Which processes a forced evict tries (scheduler/features/context_holders.py): the holder's
process tree, and NVML's processes of its uid in its session; never another uid's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from jupyter_gpushare.scheduler.features.context_holders import context_holders, process_tree

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def processes() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A holder with a child, a sibling in the same session (a double fork's orphan stands
    like it: out of the tree, in the session) and a process in a session of its own."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)",
        ]
    )
    made = {
        "holder": holder,
        "sibling": subprocess.Popen(SLEEP),
        "apart": subprocess.Popen(SLEEP, start_new_session=True),
    }
    try:
        yield made
    finally:
        for pid in process_tree(holder.pid, os.getuid())[1:]:  # its child, not ours to wait for
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in made.values():
            proc.kill()
            proc.wait()


def test_the_tree_comes_first_and_nvml_adds_only_the_holders_session(
    processes: dict[str, subprocess.Popen[bytes]],
) -> None:
    holder = processes["holder"].pid
    uid = os.getuid()
    tree: list[int] = []
    for _ in range(200):  # the child starts a moment after its parent
        tree = process_tree(holder, uid)
        if len(tree) == 2:
            break
        time.sleep(0.01)
    assert tree[0] == holder and len(tree) == 2, tree
    sibling, apart = processes["sibling"].pid, processes["apart"].pid
    found = context_holders(holder, uid, [apart, sibling, tree[1]])
    assert found == [sibling, tree[1], holder], found  # NVML's first, then the rest of the tree
    assert context_holders(holder, uid + 1, [sibling]) == []  # never another uid's
    assert process_tree(-5, uid) == []
