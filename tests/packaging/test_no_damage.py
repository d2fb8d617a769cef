"""Commands that could destroy what the user did not make refuse by default (issue 23, item 3):
``jupyter gpushare remove-kernelspec`` keeps the kernelspec pip installed, and ``bench.report``
writes its page next to the results, never over the committed docs/performance.md."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bench import report
from tests.jupyter.test_kernelspec import BIN
from tests.jupyter.test_kernelspec import jupyter as _jupyter

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "jupyter-data" / "kernels" / "python3-gpushare"


@pytest.mark.skipif(shutil.which("jupyter", path=str(BIN)) is None, reason="no jupyter command")
def test_remove_kernelspec_keeps_what_pip_installed(tmp_path: Path) -> None:
    # The environment as pip leaves it: the package's python3-gpushare in sys.prefix's share.
    env_share = tmp_path / "env" / "share" / "jupyter"
    shutil.copytree(SHIPPED, env_share / "kernels" / "python3-gpushare")
    source = tmp_path / "source" / "kernels" / "ir"
    source.mkdir(parents=True)
    (source / "kernel.json").write_text(
        json.dumps({"argv": ["R", "{connection_file}"], "display_name": "R", "language": "R"})
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env |= {
        "JUPYTER_PATH": os.pathsep.join([str(env_share), str(tmp_path / "source")]),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
    }
    user_kernels = tmp_path / "data" / "kernels"
    assert _jupyter(env, "install-kernelspec", "--user", "--name", "ir").returncode == 0

    # The --help example: it must not delete the kernelspec that came with the package.
    refused = _jupyter(env, "remove-kernelspec", "--name", "python3")
    assert refused.returncode == 1, refused.stdout
    assert "did not make it" in refused.stderr and "--force" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert (env_share / "kernels" / "python3-gpushare" / "kernel.json").is_file()
    # Without names, what install-kernelspec made goes, wherever it is, and what pip installed
    # stays, said so (issue 37: as root, install's default place needed --prefix to be removed).
    everything = _jupyter(env, "remove-kernelspec")
    assert everything.returncode == 0, everything.stderr
    assert "left: python3-gpushare" in everything.stdout, everything.stdout
    assert not (user_kernels / "ir-gpushare").exists()
    assert (env_share / "kernels" / "python3-gpushare" / "kernel.json").is_file()
    assert _jupyter(env, "install-kernelspec", "--user", "--name", "ir").returncode == 0

    # The docs' command: --user limits it to the user's own variants, which it made.
    mine = _jupyter(env, "remove-kernelspec", "--user", "--name", "ir-gpushare")
    assert mine.returncode == 0, mine.stderr
    assert not (user_kernels / "ir-gpushare").exists()
    assert _jupyter(env, "remove-kernelspec", "--user").stdout.startswith("No GPU-shared")
    assert (env_share / "kernels" / "python3-gpushare").is_dir()

    forced = _jupyter(env, "remove-kernelspec", "--name", "python3", "--force")
    assert forced.returncode == 0, forced.stderr
    assert not (env_share / "kernels" / "python3-gpushare").exists()
    assert (source / "kernel.json").is_file()


def test_bench_report_leaves_the_committed_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "tree"
    committed = tree / "docs" / "performance.md"
    committed.parent.mkdir(parents=True)
    committed.write_text("# Performance\n\nthe H100 campaign's results\n")
    monkeypatch.setattr(report, "ROOT", tree)
    out_dir = tmp_path / "OUT_DIR"
    out_dir.mkdir()

    report.main([str(out_dir)])  # as docs/performance.md gives it
    assert committed.read_text() == "# Performance\n\nthe H100 campaign's results\n"
    assert "No campaign results yet" in (out_dir / "performance.md").read_text()

    # An explicit --doc onto an existing file refuses (exit 2) unless forced.
    with pytest.raises(SystemExit) as stop:
        report.main([str(out_dir), "--doc", str(committed)])
    assert stop.value.code == 2
    assert committed.read_text().endswith("results\n")

    report.main([str(out_dir), "--update-docs"])  # the explicit flag regenerates it
    assert "No campaign results yet" in committed.read_text()
