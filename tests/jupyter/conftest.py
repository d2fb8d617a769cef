"""Fixtures of the Jupyter integration tests. The provisioner, kernelspec and magic tests' helpers
live in provisioner_helpers.py (importable by name from the tests)."""

from provisioner_helpers import kernels, shim_library  # noqa: F401
