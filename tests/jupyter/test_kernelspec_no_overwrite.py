"""install-kernelspec never replaces a kernelspec it did not make (one written by hand, or the one
pip installs) without --force, as remove-kernelspec never removes one; and what it installs where
it installs by default (as root: the system-wide Jupyter path), remove-kernelspec finds without
being told the place, even where a kernelspec of the same name earlier on the path hides it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.jupyter.test_kernelspec import jupyter, jupyter_env  # noqa: F401 (a fixture)


def _hand_made(kernels: Path) -> Path:
    mine = kernels / "ir-gpushare"
    mine.mkdir(parents=True)
    (mine / "kernel.json").write_text(
        json.dumps({"argv": ["R", "{connection_file}"], "display_name": "my hand-made one"})
    )
    return mine / "kernel.json"


def test_a_hand_made_kernelspec_is_not_replaced_without_force(
    jupyter_env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    prefix = tmp_path / "prefix"
    mine = _hand_made(prefix / "share" / "jupyter" / "kernels")
    before = mine.read_text()
    out = jupyter(jupyter_env, "install-kernelspec", "--prefix", str(prefix), "--name", "ir")
    assert out.returncode == 1, out
    assert "not replacing ir-gpushare" in out.stderr and "--force" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and mine.read_text() == before
    forced = jupyter(
        jupyter_env, "install-kernelspec", "--prefix", str(prefix), "--name", "ir", "--force"
    )
    assert forced.returncode == 0, forced.stderr
    assert json.loads(mine.read_text())["display_name"] == "R (GPU shared)"


def test_remove_finds_what_install_made_where_another_hides_it(
    jupyter_env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    # A GPU-shared ir-gpushare that install-kernelspec did not make (as pip's python3-gpushare),
    # in the user's data directory, first on the Jupyter path, hides the one installed into the
    # prefix (as the package's own python3-gpushare in a venv hides the variant root installs into
    # /usr/local/share/jupyter/kernels by default).
    theirs = tmp_path / "data" / "kernels" / "ir-gpushare"
    theirs.mkdir(parents=True)
    (theirs / "kernel.json").write_text(
        json.dumps(
            {
                "argv": ["R", "{connection_file}"],
                "display_name": "R (GPU shared, by pip)",
                "metadata": {"kernel_provisioner": {"provisioner_name": "gpushare-provisioner"}},
            }
        )
    )
    prefix = tmp_path / "prefix"
    out = jupyter(jupyter_env, "install-kernelspec", "--prefix", str(prefix), "--name", "ir")
    assert out.returncode == 0, out.stderr
    made = prefix / "share" / "jupyter" / "kernels" / "ir-gpushare"
    assert made.is_dir()
    removed = jupyter(jupyter_env, "remove-kernelspec", "--name", "ir")
    assert removed.returncode == 0, removed.stderr
    assert not made.exists(), removed.stdout
    assert f"left: ir-gpushare ({theirs})" in removed.stdout, removed.stdout
    assert (theirs / "kernel.json").is_file()
