"""``gpushare lab``: JupyterLab with gpushare, started the same way as root or as a user.

    gpushare lab [JUPYTER LAB OPTIONS ...]

It runs this environment's ``jupyter lab`` (the server extension starts the scheduler embedded in
the server) and adds only what a fresh machine needs:

- ``--allow-root`` when run as root (containers and cloud machines), which Jupyter otherwise
  refuses;
- ``--no-browser`` when there is no display to open a browser on (no ``DISPLAY`` nor
  ``WAYLAND_DISPLAY``), with a line saying to open the URL with its token that Jupyter prints;
- this environment's ``bin`` first on ``PATH``, so that the lab's terminals have ``gpushare``;
- the current directory kept off the server's import path (``python -P``), so that a source
  checkout it is started in (the README's) does not stand in for the installed package, whose
  libgpushare.so the checkout lacks.

Options given on the command line pass through unchanged and win over these.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["lab_argv", "lab_env", "main"]


def has_display(env: Mapping[str, str]) -> bool:
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")) or sys.platform == "darwin"


def interpreter() -> list[str]:
    """This Python, without the current directory first on its import path (``-P``, Python
    3.11+; before it, this environment's ``jupyter-lab`` script, whose own directory is first)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "jupyterlab"]
    script = os.path.join(os.path.dirname(sys.executable), "jupyter-lab")
    if os.path.isfile(script):
        return [sys.executable, script]
    return [sys.executable, "-m", "jupyterlab"]


def shadowing_checkout() -> str | None:
    """The directory whose ``jupyter_gpushare`` this process imported instead of an installed
    one that has its shim, when that copy has no libgpushare.so (a source checkout, imported
    through PYTHONPATH or ``python -m`` from it); None when the package is whole."""
    package = Path(__file__).resolve().parent
    if (package / "lib" / "libgpushare.so").is_file() or os.environ.get("GPUSHARE_LIBRARY"):
        return None
    return str(package.parent)


def lab_argv(args: list[str], env: Mapping[str, str], euid: int) -> list[str]:
    """The command line of ``jupyter lab`` for ``gpushare lab ARGS``."""
    extra = []
    given = {a.split("=", 1)[0] for a in args}
    if euid == 0 and not given & {"--allow-root", "--ServerApp.allow_root"}:
        extra.append("--allow-root")
    if not has_display(env) and not given & {"--no-browser", "--ServerApp.open_browser"}:
        extra.append("--no-browser")
    return [*interpreter(), *extra, *args]


def lab_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this environment's scripts (gpushare, jupyter) first on PATH."""
    out = dict(env)
    scripts = os.path.dirname(sys.executable)
    path = [p for p in out.get("PATH", "").split(os.pathsep) if p]
    if not path or path[0] != scripts:
        out["PATH"] = os.pathsep.join([scripts, *path])
    return out


def main(args: list[str]) -> None:
    """Replace this process with JupyterLab (signals and the exit status are its own)."""
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        print(
            "gpushare lab: JupyterLab is not installed here: pip install 'jupyter-gpushare[lab]'",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    checkout = shadowing_checkout()
    if checkout is not None:
        print(
            f"gpushare lab: jupyter_gpushare is imported from {checkout} (a source checkout, on "
            "the path through PYTHONPATH or `python -m`), which has no built libgpushare.so: "
            "run the installed `gpushare lab` without PYTHONPATH, or build the shim there with "
            f"`python native/build.py shim {checkout}/jupyter_gpushare/lib/libgpushare.so`",
            file=sys.stderr,
        )
        raise SystemExit(2)
    argv = lab_argv(args, os.environ, os.geteuid())
    if "--no-browser" in argv and "--no-browser" not in args:
        print(
            "gpushare lab: no display here, so no browser opens: open the URL with its token "
            "that JupyterLab prints below (`jupyter server list` prints it again)",
            file=sys.stderr,
            flush=True,
        )
    os.execve(sys.executable, argv, lab_env(os.environ))
