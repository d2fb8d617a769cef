"""docs/operators/jupyterhub.md: a hub started with the documented config whose user key file is
missing stops at once with one line naming the file (exit 1), not a traceback of JupyterHub's and
traitlets' frames. No proxy or browser: the hub stops while it loads its config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "jupyterhub" / "jupyterhub_config.py"


def test_a_hub_without_its_key_file_says_so_in_one_line(tmp_path: Path) -> None:
    hub = shutil.which("jupyterhub", path=str(Path(sys.executable).parent)) or shutil.which(
        "jupyterhub"
    )
    if hub is None:
        pytest.skip("jupyterhub is not installed (pip install -e '.[test]')")
    key = tmp_path / "user.key"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUSHARE_USER_KEY_FILE": str(key)}
    out = subprocess.run(
        [hub, "-f", str(CONFIG)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text, text
    assert text.strip().splitlines() == [
        "jupyter-gpushare: the hub cannot use the node's user key: user key file "
        f"{key} does not exist (create it with `gpushare keygen {key}`). It needs the same key "
        "as the node scheduler (c.GPUShareScheduler.user_key_file)."
    ], text
