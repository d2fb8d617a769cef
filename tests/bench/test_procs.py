"""Worker processes of the benchmarks (bench/procs.py): how an ended one ended is recorded in
full. A replay under load recorded ``{'u01': ''}`` for a user whose process had ended: its exit
status was not kept, and its stderr was read before the pipe was drained. The cause that time was
the OOM killer (the stand-in's device memory and the shim's staging are host memory, and u01 had
the largest working set): a SIGKILL, which says nothing on stderr."""

from __future__ import annotations

import signal

from bench.common import child_env
from bench.procs import WorkerProc


def test_a_killed_worker_is_reported_with_the_signal():
    # A replay that waits for its spec on stdin: alive until killed, whatever the machine has.
    w = WorkerProc(child_env(), "victim", ("replay", "/dev/stdin"))
    assert w.proc.poll() is None
    w.proc.send_signal(signal.SIGKILL)  # as the OOM killer ends a process
    report = w.exit_report()
    assert report.splitlines()[0] == f"exit status {-signal.SIGKILL}", report


def test_a_crashed_worker_is_reported_with_all_its_stderr():
    """A usage error: the worker prints its docstring on stderr and exits 1. Read at once, the
    report holds the end of that text, not an empty string."""
    w = WorkerProc(child_env(), "confused", ("no-such-command",))
    report = w.exit_report()
    lines = report.splitlines()
    assert lines[0] == "exit status 1", report
    assert len(lines) > 2 and any("replay" in line for line in lines[1:]), report
