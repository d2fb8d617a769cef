"""The GPU campaign's tools without a GPU: tests/gpu/record.py turns a campaign's output (summary,
JUnit files, logs) into docs/gpu-verification.md's section, and tests/gpu/campaign.sh on a machine
with no GPU runs nothing and says so."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_record", ROOT / "tests/gpu/record.py")
assert _spec and _spec.loader
record = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = record  # its dataclasses look their module up
_spec.loader.exec_module(record)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites>
<testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4" time="61.5">
<testcase classname="tests.gpu.test_gpu_captures" name="test_release" time="1.0"/>
<testcase classname="tests.gpu.test_gpu_captures" name="test_peak" time="50">
<failure message="AssertionError: (2214592512, 2147483648)&#10;assert 2214592512 &lt;= 2147483648"
>traceback</failure></testcase>
<testcase classname="tests.gpu.test_gpu_captures" name="test_setup">
<error message="failed on setup with &quot;RuntimeError: no NVML&quot;">trace</error></testcase>
<testcase classname="tests.gpu.test_gpu_captures.TestTwo" name="test_two[a]">
<skipped type="pytest.skip" message="needs two GPUs, this machine has 1">skip</skipped></testcase>
</testsuite></testsuites>
"""

ENVIRONMENT = """commit: 1234abc
host: vm (16 CPUs)

==============NVSMI LOG==============

Timestamp                                 : Fri Nov 27 15:30:00 2026
Driver Version                            : 580.159.04
CUDA Version                              : 13.0

Attached GPUs                             : 1
index, name, driver_version, memory.total [MiB]
0, NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB
python: 3.12.3
"""

SUMMARY = """# commit: 1234abc
# mode: suite
# date: 2026-11-27T15:30:00Z
# gpus: 1
# budget_s: 540
file\tstatus\tpassed\tfailed\terrors\tskipped\tseconds\trc
test_gpu_captures.py\tfailed\t1\t1\t1\t1\t62\t1
test_gpu_reliability.py\ttimeout after 200s\t0\t0\t0\t0\t200\t124
test_gpu_programs.py\tnot run: budget (420s usual, 38s left)\t0\t0\t0\t0\t0\t-
# not run (budget): test_gpu_programs.py
# total_s: 300
"""


def test_a_summary_row_counts_the_junit_outcomes(tmp_path: Path) -> None:
    junit = tmp_path / "captures.xml"
    junit.write_text(JUNIT)
    row = record.row("test_gpu_captures.py", junit, "1", "62", "rc")
    assert row.split("\t") == ["test_gpu_captures.py", "failed", "1", "1", "1", "1", "62", "1"]
    passing = tmp_path / "passing.xml"
    passing.write_text(
        JUNIT.split("<testcase", 1)[0].replace(
            'errors="1" failures="1" skipped="1"', 'errors="0" failures="0" skipped="0"'
        )
        + "</testsuite></testsuites>"
    )
    assert record.row("f.py", passing, "0", "5", "rc").split("\t")[1] == "passed"
    # No JUnit file: a bench part (its exit status) or a status campaign.sh gives (a timeout)
    assert record.row("handoff", tmp_path / "none.xml", "0", "9", "rc").split("\t")[1] == "ok"
    assert record.row("handoff", tmp_path / "none.xml", "3", "9", "rc").split("\t")[1] == (
        "failed (rc 3)"
    )
    assert record.row("x.py", tmp_path / "none.xml", "124", "60", "timeout after 60s").split("\t")[
        1:3
    ] == ["timeout after 60s", "0"]


def test_a_file_killed_by_its_timeout_counts_what_its_log_printed(tmp_path: Path) -> None:
    log = tmp_path / "killed.log"
    log.write_text(
        "tests/gpu/test_x.py::test_a\n---- scheduler log ----\nPASSED\n"
        "tests/gpu/test_x.py::test_b FAILED\n"
        "tests/gpu/test_x.py::test_c SKIPPED (needs two GPUs)\n"
        "FAILED tests/gpu/test_x.py::test_b - AssertionError\n"
        "tests/gpu/test_x.py::test_d \n"
    )
    row = record.row("test_x.py", tmp_path / "none.xml", "124", "155", "timeout after 155s", log)
    assert row.split("\t") == ["test_x.py", "timeout after 155s", "1", "1", "0", "1", "155", "124"]


def test_the_section_names_device_commit_files_and_failures(tmp_path: Path) -> None:
    (tmp_path / "junit").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "summary.txt").write_text(SUMMARY)
    (tmp_path / "environment.txt").write_text(ENVIRONMENT)
    (tmp_path / "junit/test_gpu_captures.xml").write_text(JUNIT)
    (tmp_path / "logs/test_gpu_reliability.log").write_text(
        "tests/gpu/test_gpu_reliability.py::test_killed_holder_handover_time PASSED\n"
        "tests/gpu/test_gpu_reliability.py::test_scheduler_restart_under_running_torch \n"
        "[scheduler] still going\n"
    )
    (tmp_path / "perf").mkdir()
    (tmp_path / "perf/cold_eviction.json").write_text("{}")
    text = record.section(tmp_path)
    lines = text.splitlines()
    assert "Result files: `perf/cold_eviction.json`." in lines
    assert lines[0] == "## 2026-11-27 — NVIDIA H100 80GB HBM3, driver 580.159.04 (CUDA 13.0)"
    assert "Commit `1234abc`, 2026-11-27T15:30:00Z, `bash tests/gpu/campaign.sh 1234abc`" in text
    assert "| `test_gpu_captures.py` | **failed** | 1 | 2 | 1 | 62 |" in lines
    assert (
        "| `test_gpu_reliability.py` | **timeout after 200s (in "
        "`test_scheduler_restart_under_running_torch`)** | 0 | 0 | 0 | 200 |"
    ) in lines
    assert "**1 passed, 2 failed, 1 skipped** in 300 s." in lines
    assert (
        "- failed: `test_gpu_captures.py::test_peak`: AssertionError: (2214592512, 2147483648)"
        in lines
    )
    assert (
        '- error: `test_gpu_captures.py::test_setup`: failed on setup with "RuntimeError: no NVML"'
        in lines
    )
    assert (
        "- skipped: `test_gpu_captures.py::TestTwo::test_two[a]`: needs two GPUs, this machine "
        "has 1" in lines
    )
    assert "Not run (the command's time ran out): test_gpu_programs.py." in lines
    assert "assert 2214592512" not in text, "a failure's message past its first line"


def test_the_campaign_without_a_gpu_runs_nothing_and_says_so(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(out),
        "FILES": "test_gpu_captures.py test_gpu.py",
    }
    done = subprocess.run(
        ["bash", "tests/gpu/campaign.sh", "1234abc"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    summary = (out / "summary.txt").read_text()
    assert "# result: no GPU (nvidia-smi lists none): nothing run" in summary
    assert "test_gpu.py\tnot run: no GPU\t0\t0\t0\t0\t0\t-" in summary.splitlines()
    with tarfile.open(out / "campaign.tar.gz") as packed:
        names = packed.getnames()
    assert "./summary.txt" in names, names
    assert "./logs/setup.log" not in names, "the device's setup ran without a GPU"
    text = record.section(out)
    assert text.startswith("## ") and " — no GPU" in text.splitlines()[0]
    assert "| `test_gpu_captures.py` | not run: no GPU | 0 | 0 | 0 | 0 |" in text


def test_the_owed_runs_name_files_and_parts_the_campaign_has() -> None:
    """docs/gpu-verification.md's owed commands must run: a FILES= name the campaign does not know
    would be skipped on the device, spending its time on nothing."""
    listed = subprocess.run(
        ["bash", "tests/gpu/campaign.sh", "-", "list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    known = {name for line in listed.splitlines() for name in line.split(":", 1)[1].split()}
    doc = (ROOT / "docs/gpu-verification.md").read_text()
    named = re.findall(r'^OUT=\S+ .*?FILES="([^"]+)"', doc, flags=re.M)
    assert named, "docs/gpu-verification.md has no FILES= command"
    unknown = sorted({n for files in named for n in files.split()} - known)
    assert not unknown, f"names the campaign does not know: {unknown}"
