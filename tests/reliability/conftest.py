"""Fixtures of the reliability tests: the scheduler tests' helpers (a live in-process scheduler and
fake shims, tests/scheduler/sched_helpers.py) next to the native harness of tests/conftest.py."""

import sys
from pathlib import Path

for _dir in ("scheduler", "jupyter"):
    _path = str(Path(__file__).resolve().parents[1] / _dir)
    if _path not in sys.path:
        sys.path.insert(0, _path)

from local_users import local_users  # noqa: E402, F401
from sched_helpers import (  # noqa: E402, F401
    connect,
    make_scheduler,
    scheduler,
    sock_path,
)
