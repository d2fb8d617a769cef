"""The sidebar's unit tests (labextension/src/__tests__, jest) as part of the one test command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LABEXTENSION = ROOT / "labextension"


def jlpm() -> list[str]:
    """jlpm (the yarn JupyterLab ships) of this interpreter's environment, else on PATH."""
    here = Path(sys.executable).parent / "jlpm"
    if here.exists():
        return [str(here)]
    found = shutil.which("jlpm")
    if found:
        return [found]
    # Where the jlpm entry point lives: jupyter_builder (current) or jupyterlab (before it).
    code = (
        "try:\n    from jupyter_builder.jlpm import main\n"
        "except ImportError:\n    from jupyterlab.jlpmapp import main\n"
        "main()"
    )
    return [sys.executable, "-c", code]


@pytest.mark.timeout(300)
def test_view_model_jest_suite() -> None:
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the sidebar's jest suite cannot run")
    env = {**os.environ, "CI": "true"}
    if not (LABEXTENSION / "node_modules" / ".bin" / "jest").exists():
        install = subprocess.run(
            [*jlpm(), "install"], cwd=LABEXTENSION, env=env, capture_output=True, text=True
        )
        assert install.returncode == 0, f"jlpm install failed:\n{install.stdout}\n{install.stderr}"
    out = subprocess.run(
        [*jlpm(), "test"], cwd=LABEXTENSION, env=env, capture_output=True, text=True, timeout=240
    )
    report = f"{out.stdout}\n{out.stderr}"
    assert out.returncode == 0, f"jest failed:\n{report}"
    assert "Tests:" in report and "failed" not in report.split("Tests:")[-1], report
