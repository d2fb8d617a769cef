"""The MPS tests' fixtures live in mps_helpers.py (importable by name from the tests)."""

from mps_helpers import children, stub_binary  # noqa: F401
