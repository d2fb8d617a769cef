"""``jupyter gpushare install-kernelspec / list-kernelspecs / remove-kernelspec``, run as a user
runs them (the ``jupyter`` command finds ``jupyter-gpushare``), in temporary Jupyter paths."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ipykernel._version import kernel_protocol_version

from jupyter_gpushare.kernelspec import (
    LOGOS,
    SOURCE_KERNELSPEC,
    is_gpushare_spec,
    logo_dir,
    make_variant,
)

BIN = Path(sys.executable).parent


@pytest.fixture
def jupyter_env(tmp_path: Path) -> dict[str, str]:
    """Jupyter paths inside tmp_path: a source kernelspec directory and a user data directory."""
    source = tmp_path / "source" / "kernels"
    (source / "ir").mkdir(parents=True)
    (source / "ir" / "kernel.json").write_text(
        json.dumps(
            {
                "argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"],
                "display_name": "R",
                "language": "R",
                "env": {"R_LIBS": "/opt/r"},
            }
        )
    )
    (source / "ir" / "logo-64x64.png").write_bytes(b"\x89PNG fake")
    (source / "remote").mkdir()
    (source / "remote" / "kernel.json").write_text(
        json.dumps(
            {
                "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Remote",
                "language": "python",
                "metadata": {"kernel_provisioner": {"provisioner_name": "other-provisioner"}},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env["JUPYTER_PATH"] = os.pathsep.join(
        [str(tmp_path / "prefix" / "share" / "jupyter"), str(tmp_path / "source")]
    )
    env["JUPYTER_DATA_DIR"] = str(tmp_path / "data")
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return env


def jupyter(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "jupyter"), "gpushare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def listing(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = jupyter(env, "list-kernelspecs", "--json")
    assert out.returncode == 0, out.stderr
    return {k["name"]: k for k in json.loads(out.stdout)["kernelspecs"]}


def test_the_shipped_kernelspec_has_the_logos_and_protocol_version() -> None:
    """jupyter-data/kernels/python3-gpushare (installed with the wheel) is what install-kernelspec
    makes of an ipykernel: the same logos and the protocol this ipykernel speaks."""
    shipped = Path(__file__).resolve().parents[2] / "jupyter-data" / "kernels" / "python3-gpushare"
    # The one copy of the logos (the wheel ships each file once): install-kernelspec takes them
    # from here.
    assert logo_dir() == shipped == SOURCE_KERNELSPEC
    for logo in LOGOS:
        assert (shipped / logo).stat().st_size > 0, logo
    spec = json.loads((shipped / "kernel.json").read_text())
    assert spec["kernel_protocol_version"] == kernel_protocol_version


def test_make_variant() -> None:
    spec = {"argv": ["x"], "display_name": "X", "metadata": {"debugger": True}}
    variant = make_variant(spec, {"memory_limit": "8GiB"})
    assert variant["display_name"] == "X (GPU shared)"
    assert variant["metadata"] == {
        "debugger": True,
        "kernel_provisioner": {
            "provisioner_name": "gpushare-provisioner",
            "config": {"memory_limit": "8GiB"},
        },
    }
    assert is_gpushare_spec(variant) and not is_gpushare_spec(spec)
    assert spec == {"argv": ["x"], "display_name": "X", "metadata": {"debugger": True}}
    assert make_variant(variant, {})["display_name"] == "X (GPU shared)"
    # An ipykernel's variant says which protocol it speaks, unless its source said.
    ipy = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]}
    assert make_variant(ipy, {})["kernel_protocol_version"] == kernel_protocol_version
    said = make_variant(dict(ipy, kernel_protocol_version="5.5"), {})
    assert said["kernel_protocol_version"] == "5.5"
    assert "kernel_protocol_version" not in variant


@pytest.mark.skipif(shutil.which("jupyter", path=str(BIN)) is None, reason="no jupyter command")
def test_help_lists_the_subcommands(jupyter_env: dict[str, str]) -> None:
    out = jupyter(jupyter_env, "--help")
    assert out.returncode == 0, out.stderr
    for sub in ("install-kernelspec", "list-kernelspecs", "remove-kernelspec"):
        assert sub in out.stdout
    assert "default_provisioner_name" in out.stdout
    out = jupyter(jupyter_env, "install-kernelspec", "--help")
    assert out.returncode == 0 and "--memory-limit" in out.stdout and "--sys-prefix" in out.stdout
    out = jupyter(jupyter_env)
    assert out.returncode == 2 and "install-kernelspec" in out.stderr


def test_install_in_a_prefix_is_idempotent(jupyter_env: dict[str, str], tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    args = ["install-kernelspec", "--prefix", str(prefix), "--memory-limit", "8GiB"]
    first = jupyter(jupyter_env, *args, "--weight", "2")
    assert first.returncode == 0, first.stderr
    kernels = prefix / "share" / "jupyter" / "kernels"
    # A variant of every kernelspec (jupyter_client hides "remote": its provisioner is missing).
    assert {p.name for p in kernels.iterdir()} == {"ir-gpushare", "python3-gpushare"}
    spec = json.loads((kernels / "ir-gpushare" / "kernel.json").read_text())
    assert spec["display_name"] == "R (GPU shared)"
    assert spec["argv"] == ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"]
    assert spec["env"] == {"R_LIBS": "/opt/r"}
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": "gpushare-provisioner",
        "config": {"memory_limit": "8GiB", "weight": 2.0},
    }
    # The variants wear gpushare's logo (the launcher and the kernel indicator show it).
    for logo in LOGOS:
        assert (kernels / "ir-gpushare" / logo).read_bytes() == (
            SOURCE_KERNELSPEC / logo
        ).read_bytes()
    py = json.loads((kernels / "python3-gpushare" / "kernel.json").read_text())
    assert "ipykernel" in " ".join(py["argv"]) and py["display_name"].endswith("(GPU shared)")
    # A variant says which protocol its kernel speaks (here the source's own, kept).
    assert py["kernel_protocol_version"]
    before = {p.name: p.read_bytes() for p in kernels.rglob("*") if p.is_file()}

    # Again: nothing changes, and no variant of a variant appears.
    again = jupyter(jupyter_env, *args, "--weight", "2")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("unchanged:") == 2
    assert {p.name: p.read_bytes() for p in kernels.rglob("*") if p.is_file()} == before
    assert not (kernels / "ir-gpushare-gpushare").exists()

    # New options update the variant in place.
    update = jupyter(jupyter_env, "install-kernelspec", "--prefix", str(prefix), "--name", "ir")
    assert update.returncode == 0, update.stderr
    spec = json.loads((kernels / "ir-gpushare" / "kernel.json").read_text())
    assert spec["metadata"]["kernel_provisioner"]["config"] == {}

    found = listing(jupyter_env)
    assert found["ir-gpushare"]["gpushare"] and not found["ir"]["gpushare"]
    assert found["python3-gpushare"]["config"] == {"memory_limit": "8GiB", "weight": 2.0}
    text = jupyter(jupyter_env, "list-kernelspecs")
    assert text.returncode == 0 and "R (GPU shared)" in text.stdout

    removed = jupyter(jupyter_env, "remove-kernelspec", "--name", "ir")
    assert removed.returncode == 0, removed.stderr
    assert not (kernels / "ir-gpushare").exists()
    assert (tmp_path / "source" / "kernels" / "ir" / "kernel.json").exists()
    refused = jupyter(jupyter_env, "remove-kernelspec", "--name", "ir")
    assert refused.returncode == 1 and "not a GPU-shared kernelspec" in refused.stderr
    assert jupyter(jupyter_env, "remove-kernelspec").returncode == 0
    assert not any(kernels.iterdir())


def test_install_for_the_user(jupyter_env: dict[str, str], tmp_path: Path) -> None:
    out = jupyter(jupyter_env, "install-kernelspec", "--user", "--name", "ir")
    assert out.returncode == 0, out.stderr
    path = tmp_path / "data" / "kernels" / "ir-gpushare" / "kernel.json"
    assert is_gpushare_spec(json.loads(path.read_text()))
    assert listing(jupyter_env)["ir-gpushare"]["resource_dir"] == str(path.parent)


def test_clear_errors(jupyter_env: dict[str, str], tmp_path: Path) -> None:
    prefix = ["--prefix", str(tmp_path / "prefix")]
    out = jupyter(jupyter_env, "install-kernelspec", *prefix, "--name", "nope")
    assert out.returncode == 1
    assert "no kernelspec named 'nope'" in out.stderr and "ir" in out.stderr
    out = jupyter(jupyter_env, "install-kernelspec", *prefix, "--memory-limit", "8 parsecs")
    assert out.returncode == 2 and "--memory-limit" in out.stderr and "invalid size" in out.stderr
    out = jupyter(jupyter_env, "install-kernelspec", *prefix, "--weight", "-1")
    assert out.returncode == 2 and "--weight" in out.stderr
    out = jupyter(jupyter_env, "install-kernelspec", "--user", *prefix)
    assert out.returncode == 2 and "one of --user, --sys-prefix and --prefix" in out.stderr
    assert jupyter(jupyter_env, "install-kernelspec", *prefix, "--name", "ir").returncode == 0
    out = jupyter(jupyter_env, "install-kernelspec", *prefix, "--name", "ir-gpushare")
    assert out.returncode == 1 and "already a GPU-shared kernelspec" in out.stderr
    if os.geteuid() != 0:
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
        out = jupyter(jupyter_env, "install-kernelspec", "--prefix", str(readonly / "p"))
        assert out.returncode == 1 and "permission denied" in out.stderr
        assert "--user" in out.stderr
