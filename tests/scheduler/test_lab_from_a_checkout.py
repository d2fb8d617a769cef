"""`gpushare lab` started inside a source checkout while the package is installed elsewhere (the
README's first command): the server imports the installed package, not the checkout's copy that
has no libgpushare.so; where the checkout's copy is imported all the same (PYTHONPATH), the
command says so in one line and what to do, instead of a kernel failing later with HTTP 500."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from jupyter_gpushare.launch import interpreter

ROOT = Path(__file__).resolve().parents[2]


def test_the_lab_does_not_import_the_checkout_it_starts_in(tmp_path: Path) -> None:
    shadow = tmp_path / "jupyter_gpushare"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the checkout, not the install')\n")
    # The lab's interpreter and its options, running a probe instead of JupyterLab.
    prefix = interpreter()[:-2] if interpreter()[-2:] == ["-m", "jupyterlab"] else [sys.executable]
    out = subprocess.run(
        [*prefix, "-c", "import jupyter_gpushare; print(jupyter_gpushare.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(ROOT / "jupyter_gpushare" / "__init__.py")


def test_a_checkout_without_its_shim_is_named_in_one_line(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    shutil.copytree(
        ROOT / "jupyter_gpushare",
        checkout / "jupyter_gpushare",
        ignore=shutil.ignore_patterns("lib", "labextension", "__pycache__"),
    )
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_LIBRARY"}
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "lab"],
        cwd=checkout,
        env={**env, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert len(text.strip().splitlines()) == 1 and "Traceback" not in text, text
    assert f"jupyter_gpushare is imported from {checkout}" in text, text
    assert "native/build.py shim" in text and "without PYTHONPATH" in text, text
