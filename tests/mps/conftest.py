"""The MPS tests' fixtures live in mps_helpers.py (importable by name from the tests); the real
kernels come from the Jupyter tests' helpers (tests/jupyter/provisioner_helpers.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jupyter"))

from mps_helpers import children, stub_binary  # noqa: F401
from provisioner_helpers import kernels, shim_library  # noqa: F401
