"""The distributions, built as a release builds them: an sdist from this tree, then a wheel from
that sdist with no Node.js on PATH (the prebuilt sidebar travels in the sdist), then the wheel
proved manylinux by auditwheel (docs/install.md's build commands). Plus the metadata the package
indexes show and the one version shared by the Python package and the JupyterLab extension."""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREBUILT = ROOT / "jupyter_gpushare" / "labextension" / "package.json"
#: Programs whose absence proves the wheel builds without the JavaScript toolchain.
NODE_TOOLS = ("node", "nodejs", "npm", "jlpm", "yarn")


def _version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "jupyter_gpushare" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


def test_one_version_for_python_and_the_labextension() -> None:
    """_version.py is the source (hatch reads it); labextension/package.json must carry the same
    release, or JupyterLab shows one version and pip another."""
    npm = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    assert npm == _version(), "bump labextension/package.json with _version.py"


def test_license_file_is_the_declared_license() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "jupyter-gpushare developers" in text
    assert "Neither the name of the copyright holder" in text  # clause 3


def _path_without_node(shadow: Path) -> str:
    """A one-directory PATH with every program of PATH but Node.js's (on Debian, node and the C
    compiler share /usr/bin, so dropping directories would drop the compiler too)."""
    shadow.mkdir()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry or not os.path.isdir(entry):
            continue
        for prog in os.listdir(entry):
            target = shadow / prog
            if prog not in NODE_TOOLS and not target.exists() and not target.is_symlink():
                target.symlink_to(os.path.join(entry, prog))
    return str(shadow)


def _backend(call: str, cwd: Path, out: Path, env: dict[str, str]) -> Path:
    """Run hatchling's PEP 517 hook in a fresh interpreter; return the artifact it wrote."""
    code = f"import sys, hatchling.build as b; print(b.{call}(sys.argv[1]))"
    res = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return out / res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if not PREBUILT.exists():
        pytest.fail(
            f"{PREBUILT.relative_to(ROOT)} is missing: build the sidebar first "
            "(`pip install -e .` or `jlpm --cwd labextension build:prod`)",
            pytrace=False,
        )
    tmp = tmp_path_factory.mktemp("dists")
    env = {**os.environ, "PATH": os.environ.get("PATH", "")}
    env.pop("GPUSHARE_WHEEL_PLAT", None)
    sdist = _backend("build_sdist", ROOT, tmp, env)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "src", filter="data")
    [src] = (tmp / "src").iterdir()
    env["PATH"] = _path_without_node(tmp / "bin")
    assert shutil.which("node", path=env["PATH"]) is None
    wheel = _backend("build_wheel", src, tmp, env)
    return sdist, wheel


def test_sdist_carries_the_prebuilt_sidebar_and_the_license(dists: tuple[Path, Path]) -> None:
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert "LICENSE" in names
    assert "jupyter_gpushare/labextension/package.json" in names
    assert "native/src/base/hooks.def" in names and "native/build.py" in names


def test_wheel_from_the_sdist_without_node(dists: tuple[Path, Path]) -> None:
    _, wheel = dists
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.message_from_bytes(
            zf.read(f"jupyter_gpushare-{_version()}.dist-info/METADATA")
        )
    assert "jupyter_gpushare/lib/libgpushare.so" in names
    ext = f"jupyter_gpushare-{_version()}.data/data/share/jupyter/labextensions/jupyter-gpushare"
    assert f"{ext}/package.json" in names
    assert any(n.startswith(f"{ext}/static/") and n.endswith(".js") for n in names)
    assert f"jupyter_gpushare-{_version()}.dist-info/licenses/LICENSE" in names
    assert meta["Name"] == "jupyter-gpushare" and meta["License-Expression"] == "BSD-3-Clause"
    classifiers = set(meta.get_all("Classifier"))
    for c in (
        "Framework :: Jupyter :: JupyterLab :: 4",
        "Framework :: Jupyter :: JupyterLab :: Extensions :: Prebuilt",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.13",
    ):
        assert c in classifiers, c
    assert any(c.startswith("Development Status ::") for c in classifiers)
    urls = {u.split(",")[0] for u in meta.get_all("Project-URL")}
    assert {"Homepage", "Source", "Issues", "Documentation", "Changelog"} <= urls


def test_auditwheel_calls_the_wheel_manylinux(dists: tuple[Path, Path]) -> None:
    """The tag hatch_build.py writes is one auditwheel agrees with: the shim needs nothing outside
    the manylinux policy (no CUDA library is linked; the driver is dlopen'ed at run time), and
    the glibc the tag promises is at least the newest symbol version the shim uses."""
    _, wheel = dists
    tag = re.search(r"-py3-none-manylinux_2_(\d+)_(\w+)\.whl$", wheel.name)
    assert tag, wheel.name
    res = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    text = " ".join(res.stdout.split())
    found = re.search(
        r'is consistent with the following platform tag: "manylinux_2_(\d+)_(\w+)"', text
    )
    assert found, text
    assert found.group(2) == tag.group(2), text
    assert int(found.group(1)) <= int(tag.group(1)), f"the tag promises too old a glibc: {text}"
    assert "libcuda" not in text
    # RHEL 8/9 and Ubuntu 20.04/22.04 (glibc 2.28-2.35), where most JupyterHubs run, take it.
    assert int(tag.group(1)) <= 28, f"{wheel.name}: is the test extra's ziglang installed?"


def test_check_wheel_contents_passes(dists: tuple[Path, Path]) -> None:
    """check-wheel-contents finds nothing wrong: no file twice (the kernel logos are shipped once,
    in the python3-gpushare kernelspec), no stray bytecode or build leftovers."""
    _, wheel = dists
    res = subprocess.run(
        [sys.executable, "-m", "check_wheel_contents", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert ": OK" in res.stdout, res.stdout
    with zipfile.ZipFile(wheel) as zf:
        logos = [n for n in zf.namelist() if Path(n).name == "logo-64x64.png"]
    kernels = f"jupyter_gpushare-{_version()}.data/data/share/jupyter/kernels"
    assert logos == [f"{kernels}/python3-gpushare/logo-64x64.png"], logos


def test_installed_kernelspec_gives_the_logos(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed from the wheel (no source tree beside the package), install-kernelspec takes the
    logos from the python3-gpushare kernelspec where Jupyter finds it."""
    from jupyter_gpushare import kernelspec

    installed = tmp_path / "share" / "jupyter" / "kernels" / kernelspec.SHIPPED_KERNELSPEC
    shutil.copytree(kernelspec.SOURCE_KERNELSPEC, installed)
    monkeypatch.setattr(kernelspec, "SOURCE_KERNELSPEC", tmp_path / "no-source-tree")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    assert kernelspec.logo_dir() == installed
    (installed / "logo-svg.svg").unlink()
    found = kernelspec.logo_dir()
    assert found is None or found != installed
