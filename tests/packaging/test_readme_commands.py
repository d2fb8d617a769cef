"""The README opens with two commands (run JupyterLab; run the tests) and CI must run the second
one verbatim: a README whose test command drifts from .ci/run fails here.

Every shell block of README.md and docs/**/*.md says, in an HTML comment on the line before it,
either which test runs it (``<!-- commands: tested by PATH -->``; PATH names the doc) or what it
needs that CI has not (``<!-- commands: need a GPU -->``, ``need root on a GPU node``, ``need a
cluster``, ``need Docker``). The blocks this file names, it runs here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NEEDS = {"need a GPU", "need root on a GPU node", "need a cluster", "need Docker"}
BLOCK = re.compile(r"^([ \t]*)```(?:bash|sh|shell|console)\n(.*?)^\1```", re.S | re.M)
MARK = re.compile(r"<!-- commands: (.+?) -->\s*$")


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")]  # the commands stand before the first section
    return re.findall(r"```bash\n(.+?)\n```", head)


def _shell_blocks() -> list[tuple[str, str | None, str]]:
    """(doc, its mark or None, the block's commands) for every shell block of the docs."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        for block in BLOCK.finditer(text):
            before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            body = "\n".join(line.strip() for line in block.group(2).splitlines())
            found.append((str(doc.relative_to(ROOT)), mark and mark.group(1), body))
    return found


def _block(doc: str, first: str) -> str:
    [body] = [b for d, _m, b in _shell_blocks() if d == doc and b.startswith(first)]
    return body


def test_the_readme_opens_with_a_lab_command_and_a_test_command() -> None:
    lab, tests = _readme_commands()
    assert lab.endswith(".venv/bin/gpushare lab"), lab
    assert tests.endswith(".venv/bin/pytest"), tests


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    _lab, tests = _readme_commands()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, f"{tests!r} is not a line of .ci/run"
    # Then the slow tier (tests/tiers.py) that the README's command leaves out, in the same venv.
    slow = ".venv/bin/pytest -m slow"
    assert slow in ci_lines, f"{slow!r} is not a line of .ci/run"
    assert ci_lines.index(slow) > ci_lines.index(tests), ".ci/run runs the slow tier first"


def test_every_doc_command_is_tested_or_says_what_it_needs() -> None:
    blocks = _shell_blocks()
    assert len(blocks) > 15
    for doc, mark, body in blocks:
        where = f"{doc}: {body.splitlines()[0]!r}"
        assert mark, f"{where}: no <!-- commands: ... --> line before the block"
        if mark.startswith("tested by "):
            test = ROOT / mark.removeprefix("tested by ")
            assert test.is_file(), f"{where}: {test} does not exist"
            assert Path(doc).name in test.read_text(), f"{where}: {test} does not name {doc}"
        else:
            assert mark in NEEDS, f"{where}: {mark!r} is neither 'tested by PATH' nor {NEEDS}"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "GPUSHARE"))}
    env |= {
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_PATH": str(tmp_path / "share"),
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        "PYTHONPATH": str(ROOT),
    }
    return env


def _bash(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_kernelspec_commands_of_jupyter_md(tmp_path: Path) -> None:
    env = _env(tmp_path)
    myenv = tmp_path / "share" / "kernels" / "myenv"
    myenv.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (myenv / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "myenv"}))
    out = _bash(_block("docs/jupyter.md", "jupyter gpushare install"), env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "removed: myenv-gpushare" in out.stdout
    assert not (tmp_path / "data" / "kernels" / "myenv-gpushare").exists()


def test_the_scheduler_and_status_commands_of_the_user_guide(tmp_path: Path) -> None:
    """user-guide.md's scheduler (its second line: the first is the same without --pool) and
    its three status commands (--watch ended by Ctrl-C, as the guide says)."""
    env = _env(tmp_path)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env["GPUSHARE_SOCKET"] = str(run / "scheduler.sock")
    scheduler_line = _block("docs/user-guide.md", "gpushare scheduler").splitlines()[1]
    sched = subprocess.Popen(
        ["bash", "-c", f"exec {scheduler_line}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run / "scheduler.sock").exists():
            assert sched.poll() is None, sched.stderr.read() if sched.stderr else ""
            assert time.monotonic() < deadline, "the scheduler did not listen within 60 s"
            time.sleep(0.1)
        status, as_json, watch = _block("docs/user-guide.md", "gpushare status").splitlines()
        out = _bash(status, env, tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert env["GPUSHARE_SOCKET"] in out.stdout, out.stdout
        out = _bash(as_json, env, tmp_path)
        assert out.returncode == 0, out.stderr
        json.loads(out.stdout)
        watching = subprocess.Popen(
            ["bash", "-c", f"exec {watch}"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(3)
        watching.send_signal(signal.SIGINT)  # Ctrl-C
        text, _ = watching.communicate(timeout=30)
        assert watching.returncode == 0 and "Every 2 s" in text, text
    finally:
        sched.terminate()
        sched.wait(timeout=30)


@pytest.mark.parametrize("doc", ["docs/install.md"])
def test_the_docs_name_the_packages_their_commands_need(doc: str) -> None:
    """`python -m build` and `auditwheel` are not in a fresh environment: the block installs
    them."""
    body = _block(doc, "pip install build")
    assert "build" in body.splitlines()[0] and "auditwheel" in body.splitlines()[0]
