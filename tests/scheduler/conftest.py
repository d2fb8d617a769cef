"""The scheduler tests' fixtures live in sched_helpers.py (importable by name from the tests)."""

from sched_helpers import (  # noqa: F401
    connect,
    make_scheduler,
    scheduler,
    sock_path,
)
