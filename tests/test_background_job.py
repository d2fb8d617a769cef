"""The test command started from a background job (``pytest &`` in a script, a CI wrapper):
such a job inherits SIGINT and SIGQUIT as ignored (``nohup``: SIGHUP too), and an ignored
disposition is inherited by everything the tests start. tests/conftest.py gives the programs the
tests start the default dispositions back (``restore_default_signals``); this runs a small test
session in that situation and reads what its child was left ignoring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import SIGNALS_SENT

ROOT = Path(__file__).resolve().parents[1]


def ignored(status: str) -> set[int]:
    """The signals ignored according to a /proc/<pid>/status text."""
    line = next(x for x in status.splitlines() if x.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


def test_children_of_a_background_test_run_get_the_default_dispositions(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        textwrap.dedent(
            """
            import os
            import signal
            import subprocess


            def test_probe():
                child = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True)
                print("CHILD", child.stdout.split("SigIgn:")[1].split()[0])
                for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
                    os.kill(os.getpid(), sig)
                print("SURVIVED")
            """
        )
    )
    sent = " ".join(str(int(s)) for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP))
    # As a shell starts a background job: the three signals ignored, then the test command.
    out = subprocess.run(
        [
            "sh",
            "-c",
            f'trap "" {sent}; exec "$0" -m pytest -q -s -p no:cacheprovider -p tests.conftest '
            f'--rootdir "$1" "$1"',
            sys.executable,
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # The test process itself still ignores them, as the job asked...
    assert "SURVIVED" in out.stdout, out.stdout + out.stderr
    # ...and a program it starts begins with none of the signals the tests send ignored.
    mask = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("CHILD "))
    child = ignored(f"SigIgn: {mask}")
    assert child.isdisjoint(int(s) for s in SIGNALS_SENT), sorted(child)
