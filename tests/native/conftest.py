"""Fixtures of the native tests beyond the shared ones (tests/conftest.py)."""

from tests.native.probe import shim_probe  # noqa: F401  (a fixture, registered here)
