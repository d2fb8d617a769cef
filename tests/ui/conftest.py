"""Fixtures of the browser tests; they live in ui_helpers.py (importable by name from the tests)."""

from ui_helpers import chromium, lab  # noqa: F401
