"""A GPU campaign's output as a section of docs/gpu-verification.md (tests/gpu/campaign.sh).

    python3 tests/gpu/record.py OUT            # the markdown section, to paste into the record
    python3 tests/gpu/record.py env            # versions of the stack (campaign.sh, on the device)
    python3 tests/gpu/record.py row NAME JUNIT RC SECONDS STATUS [LOG]   # a line of summary.txt

OUT is the directory campaign.sh wrote: summary.txt (``# key: value`` lines, then one
tab-separated row per file), environment.txt, junit/*.xml and logs/*.log. Needs only the
standard library: it runs on the device and here.
"""

from __future__ import annotations

import gzip
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

COLUMNS = ("file", "status", "passed", "failed", "errors", "skipped", "seconds", "rc")
PACKAGES = (
    "torch",
    "cupy-cuda12x",
    "cupy-cuda13x",
    "jax",
    "transformers",
    "timm",
    "lightning",
    "triton",
    "grpcio",
    "protobuf",
    "jupyter_server",
    "ipykernel",
    "jupyter-gpushare",
)


@dataclass
class Case:
    """One test case of a JUnit file: its id, outcome and the first line of its message."""

    name: str
    outcome: str  # passed, failed, error, skipped
    message: str = ""


@dataclass
class Suite:
    tests: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    cases: list[Case] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return self.tests - self.failed - self.errors - self.skipped


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def case_id(classname: str, name: str) -> str:
    """pytest's id from a JUnit classname: ``tests.gpu.test_x.TestY`` is ``test_x.py::TestY``."""
    parts = classname.split(".")
    module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "::".join([f"{parts[module]}.py", *parts[module + 1 :], name])


def read_junit(path: Path) -> Suite | None:
    """pytest's JUnit XML (one or more testsuite elements); None when absent or unreadable (a
    file cut short by its timeout writes none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = Suite()
    for suite in root.iter("testsuite"):
        out.tests += int(suite.get("tests", 0))
        out.failed += int(suite.get("failures", 0))
        out.errors += int(suite.get("errors", 0))
        out.skipped += int(suite.get("skipped", 0))
        out.seconds += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            name = case_id(case.get("classname", ""), case.get("name", ""))
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error"}.get(tag, tag)
                    message = first_line(el.get("message")) or first_line(el.text)
                    break
            out.cases.append(Case(name, outcome, message))
    return out


OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b(?! tests/)")


def from_log(log: str) -> Suite | None:
    """Outcomes a -v log printed, for a file whose pytest was killed before its JUnit file."""
    words = [
        w
        for line in log.splitlines()
        if not line.startswith(("FAILED ", "ERROR "))
        for w in OUTCOME.findall(line)
    ]
    if not words:
        return None
    count = {w: words.count(w) for w in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return Suite(len(words), count["FAILED"], count["ERROR"], count["SKIPPED"])


def row(name: str, junit: Path, rc: str, seconds: str, status: str, log: Path | None = None) -> str:
    """One tab-separated line of summary.txt. ``status`` "rc" means: say it from the outcomes.
    Without a JUnit file (pytest killed by its timeout), the counts are those the log printed."""
    suite = read_junit(junit)
    if suite is None and log is not None:
        try:
            suite = from_log(log.read_text(errors="replace"))
        except OSError:
            suite = None
    counts = (suite.passed, suite.failed, suite.errors, suite.skipped) if suite else (0, 0, 0, 0)
    if status == "rc":
        if suite is None:
            status = "ok" if rc == "0" else f"failed (rc {rc})"
        elif rc == "5" or suite.tests == 0:
            status = "no tests collected"
        elif suite.failed or suite.errors or rc != "0":
            status = "failed"
        elif suite.skipped == suite.tests:
            status = "skipped"
        else:
            status = "passed"
    return "\t".join([name, status, *map(str, counts), seconds, rc])


def read_summary(out: Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """summary.txt's ``# key: value`` header (and footer) and its rows."""
    meta: dict[str, str] = {}
    rows: list[dict[str, str]] = []
    for line in (out / "summary.txt").read_text().splitlines():
        if line.startswith("# ") and ": " in line:
            key, value = line[2:].split(": ", 1)
            meta[key.strip()] = value.strip()
        elif line and not line.startswith("file\t"):
            cells = line.split("\t")
            cells += [""] * (len(COLUMNS) - len(cells))
            rows.append(dict(zip(COLUMNS, cells[: len(COLUMNS)], strict=True)))
    return meta, rows


def device_line(out: Path) -> tuple[str, str, str]:
    """(device names, driver, CUDA version) from environment.txt's nvidia-smi output."""
    try:
        text = (out / "environment.txt").read_text(errors="replace")
    except OSError:
        return "no environment.txt", "", ""
    names = re.findall(r"^\d+, ([^,]+), [0-9.]+, ", text, re.M)
    driver = re.search(r"Driver Version\s*:\s*(\S+)", text)
    cuda = re.search(r"CUDA Version\s*:\s*(\S+)", text)
    if names and len(set(names)) == 1 and len(names) > 1:
        device = f"{len(names)} x {names[0]}"
    else:
        device = " and ".join(names) or "no GPU"
    return device, driver.group(1) if driver else "", cuda.group(1) if cuda else ""


def log_text(out: Path, name: str) -> str:
    base = name.removesuffix(".py").replace("/", "_")
    plain, packed = out / "logs" / f"{base}.log", out / "logs" / f"{base}.log.gz"
    try:
        if packed.exists():
            return gzip.decompress(packed.read_bytes()).decode(errors="replace")
        return plain.read_text(errors="replace")
    except OSError:
        return ""


def last_started(log: str) -> str:
    """The last test a -v log started (what a timeout cut)."""
    found = re.findall(r"^(\S+\.py::\S+)", log, re.M)
    return found[-1] if found else ""


def section(out: Path) -> str:
    meta, rows = read_summary(out)
    device, driver, cuda = device_line(out)
    date = meta.get("date", "")
    commit = meta.get("commit", "?")
    mode = meta.get("mode", "suite")
    title = f"## {date[:10]} — {device}" + (f", driver {driver}" if driver else "")
    title += f" (CUDA {cuda})" if cuda else ""
    lines = [title, ""]
    command = f"bash tests/gpu/campaign.sh {commit}" + (" bench" if mode == "bench" else "")
    lines.append(
        f"Commit `{commit}`, {date}, `{command}`"
        + (f" (FILES={meta['files']})" if meta.get("files") else "")
        + f"; environment in [environment.txt](gpu-runs/{date[:10]}/environment.txt)."
    )
    if "result" in meta:
        lines += ["", f"**{meta['result']}.**"]
    lines += [
        "",
        "| file | result | passed | failed | skipped | seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    totals = [0, 0, 0]
    for r in rows:
        failed = int(r["failed"] or 0) + int(r["errors"] or 0)
        counts = [int(r["passed"] or 0), failed, int(r["skipped"] or 0)]
        totals = [a + b for a, b in zip(totals, counts, strict=True)]
        result = r["status"]
        if result.startswith("timeout") and (cut := last_started(log_text(out, r["file"]))):
            result += f" (in `{cut.split('::', 1)[1]}`)"
        bold = "**" if failed or result.startswith(("failed", "timeout")) else ""
        lines.append(
            f"| `{r['file']}` | {bold}{result}{bold} | {counts[0]} | {counts[1]} | {counts[2]} "
            f"| {r['seconds']} |"
        )
    lines += ["", f"**{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped**"]
    if "total_s" in meta:
        lines[-1] += f" in {meta['total_s']} s"
    lines[-1] += "."
    notes: list[str] = []
    for r in rows:
        suite = read_junit(out / "junit" / f"{r['file'].removesuffix('.py').replace('/', '_')}.xml")
        for case in suite.cases if suite else []:
            if case.outcome in ("failed", "error", "skipped"):
                notes.append(f"- {case.outcome}: `{case.name}`: {case.message or '(no message)'}")
    if notes:
        lines += ["", *notes]
    results = sorted(p.relative_to(out).as_posix() for p in out.glob("perf/**/*.json"))
    if results:
        lines += ["", "Result files: " + ", ".join(f"`{r}`" for r in results) + "."]
    if meta.get("not run (budget)"):
        lines += ["", f"Not run (the command's time ran out): {meta['not run (budget)']}."]
    return "\n".join(lines) + "\n"


def versions() -> str:
    lines = [f"python: {sys.version.split()[0]}"]
    for name in PACKAGES:
        try:
            lines.append(f"{name}: {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        print(versions())
    elif argv[:1] == ["row"] and len(argv) in (6, 7):
        log = Path(argv[6]) if len(argv) == 7 else None
        print(row(argv[1], Path(argv[2]), argv[3], argv[4], argv[5], log))
    elif len(argv) == 1 and not argv[0].startswith("-"):
        sys.stdout.write(section(Path(argv[0])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
