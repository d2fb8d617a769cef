"""What every benchmark harness shares: metadata, a scheduler subprocess, shimmed environments.

Every harness returns one JSON-able *record*: ``{"benchmark": name, "meta": {...}, ...}``. The
metadata says where and how the numbers were taken (device, driver, CUDA, torch, date, command,
git commit), so that a result file stands on its own.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MiB = 1 << 20


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark child: the source tree importable, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def shim_env(socket: Path, client_id: str | None = None, **extra: str) -> dict[str, str]:
    from jupyter_gpushare.shim import shim_environment

    return shim_environment(child_env(extra), socket=str(socket), client_id=client_id)


# --------------------------------------------------------------------------------------------
# Metadata


def _run_text(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _torch_versions() -> dict[str, str]:
    code = (
        "import json,torch;print(json.dumps({'torch': torch.__version__,"
        "'torch_cuda': torch.version.cuda or ''}))"
    )
    text = _run_text([sys.executable, "-c", code])
    try:
        return dict(json.loads(text.splitlines()[-1]))
    except (ValueError, IndexError):
        return {"torch": "not available", "torch_cuda": ""}


def source_digest() -> str:
    """SHA-256 of the code that produces the numbers (bench/, jupyter_gpushare/, native/): it
    names the code even where the copy on a device machine has no git history."""
    h = hashlib.sha256()
    files = [
        *ROOT.glob("bench/*.py"),
        *ROOT.glob("bench/*.c"),
        *ROOT.glob("jupyter_gpushare/**/*.py"),
        *ROOT.glob("native/src/**/*"),
        *ROOT.glob("native/include/*"),
    ]
    for f in sorted(p for p in files if p.is_file()):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


_META: dict[str, Any] | None = None


def environment() -> dict[str, Any]:
    """Device, driver, CUDA, torch, Python, host, git commit (computed once per process)."""
    global _META
    if _META is None:
        smi = _run_text(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        )
        cuda = re.search(r"CUDA Version:\s*([0-9.]+)", _run_text(["nvidia-smi"]))
        parts = [p.strip() for p in smi.splitlines()[0].split(",")] if smi else []
        _META = {
            "device": parts[0] if parts else "none (no nvidia-smi)",
            "driver": parts[1] if len(parts) > 1 else "",
            "device_memory": parts[2] if len(parts) > 2 else "",
            "cuda": cuda.group(1) if cuda else "",
            **_torch_versions(),
            "python": platform.python_version(),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            # GPUSHARE_BENCH_COMMIT wins when set: a copy of the tree (a GPU machine that was
            # sent the working tree) may carry an older .git than the code it runs.
            "git_commit": os.environ.get("GPUSHARE_BENCH_COMMIT")
            or _run_text(["git", "rev-parse", "HEAD"])
            or "unknown",
            "source_digest": source_digest(),
            "git_dirty": bool(_run_text(["git", "status", "--porcelain", "--untracked-files=no"])),
        }
    return dict(_META)


def record(benchmark: str, command: Sequence[str] | None = None, **fields: Any) -> dict[str, Any]:
    meta = environment()
    meta["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta["command"] = shlex.join(command if command is not None else [sys.executable, *sys.argv])
    return {"benchmark": benchmark, "meta": meta, **fields}


def meta_line(rec: dict[str, Any]) -> str:
    """A record's metadata (:func:`record`) as the small print under its section of
    docs/performance.md (bench/report.py and the sections it draws from other modules)."""
    m = rec.get("meta", {})
    where = f"{m.get('device', '?')}, driver {m.get('driver', '?')}, CUDA {m.get('cuda', '?')}"
    torch = m.get("torch", "?")
    if m.get("torch_cuda"):
        torch += f" (CUDA {m['torch_cuda']})"
    dirty = " (uncommitted changes)" if m.get("git_dirty") else ""
    line = (
        f"<sub>Measured {m.get('date', '?')} on {where}, torch {torch}, commit "
        f"`{str(m.get('git_commit', '?'))[:12]}`{dirty} (source digest "
        f"`{m.get('source_digest', '?')}`), {rec.get('duration_s', '?')} s: "
        f"`{m.get('command', '?')}`</sub>"
    )
    if rec.get("driver") == "stand-in" or rec.get("results_driver") == "stand-in":
        line = "> **Stand-in driver, no GPU: these numbers check the harness only.**\n\n" + line
    return line


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Median and a distribution-free confidence interval (order statistics of the binomial).

    For n values the interval is [x_(j), x_(k)] with j, k the binomial quantiles around n/2;
    exact for any continuous distribution, no bootstrap needed.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return (float("nan"),) * 3
    med = statistics.median(xs)
    if n < 6:
        return med, xs[0], xs[-1]
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    half = z * (n**0.5) / 2
    lo = max(0, int(n / 2 - half))
    hi = min(n - 1, int(n / 2 + half + 0.999))
    return med, xs[lo], xs[hi]


# --------------------------------------------------------------------------------------------
# The scheduler, as an operator starts it


@dataclass
class Scheduler:
    socket: Path
    log: Path
    process: subprocess.Popen[bytes]

    def status(self) -> dict[str, Any]:
        from jupyter_gpushare.scheduler_client import SchedulerClient

        return SchedulerClient(str(self.socket)).status_sync()

    def clients(self) -> dict[str, dict[str, Any]]:
        doc = self.status()
        return {c["id"]: c for dev in doc.get("devices", []) for c in dev.get("clients", [])}

    def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        from jupyter_gpushare.scheduler_client import SchedulerClient

        return SchedulerClient(str(self.socket)).control_sync(action, **kwargs)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def scheduler(
    workdir: Path, *args: str, no_nvml: bool = False, log_level: str = "INFO"
) -> Iterator[Scheduler]:
    """A scheduler subprocess (``gpushare scheduler ARGS``) on a fresh socket under ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    # Unix socket paths are short (108 bytes): keep the socket in a short temporary directory.
    sockdir = Path(tempfile.mkdtemp(prefix="gsb-", dir="/tmp"))
    sock = sockdir / "s.sock"
    log = workdir / f"scheduler-{int(time.time() * 1000)}.log"
    cmd = [sys.executable, "-m", "jupyter_gpushare", "scheduler", "--socket", str(sock)]
    cmd += ["--log-level", log_level, *(["--no-nvml"] if no_nvml else []), *args]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env())
    sched = Scheduler(sock, log, proc)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler did not start:\n{log.read_text()}")
            time.sleep(0.02)
        yield sched
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


_MOVE = re.compile(
    r"(?P<kind>release|restored|evicted) client=(?P<client>\S+)(?: evicted=(?P<ev>\d))?"
    r" bytes=(?P<bytes>\d+) \([^)]*\) ms=(?P<ms>[0-9.]+)(?P<rest>.*)"
)


def memory_moves(log_text: str) -> list[dict[str, Any]]:
    """Evictions and restores the scheduler logged: kind, client, bytes, seconds, in order."""
    out = []
    for m in _MOVE.finditer(log_text):
        kind = m.group("kind")
        if kind == "release" or "(on release)" in m.group("rest"):
            if kind == "release":
                if m.group("ev") != "1":
                    continue
                kind = "evicted"
            else:
                continue  # the same move, logged twice
        out.append(
            {
                "kind": "evict" if kind == "evicted" else "restore",
                "client": m.group("client"),
                "bytes": int(m.group("bytes")),
                "seconds": float(m.group("ms")) / 1000.0,
            }
        )
    return out


class Progress:
    """A long benchmark's progress, one line on stderr per step: how many of how many, the time
    so far and, once a step is done, about how long is left."""

    def __init__(self, name: str, total: int | None = None) -> None:
        self.name = name
        self.total = total
        self.done = 0
        self.started = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        left = ""
        if self.total and self.done < self.total:
            left = f", about {_duration(elapsed / self.done * (self.total - self.done))} left"
        print(
            f"{self.name}: {count} {what} ({_duration(elapsed)}{left})", file=sys.stderr, flush=True
        )

    def note(self, what: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"{self.name}: {what} ({_duration(elapsed)})", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def stop_cleanly(main: Any, name: str) -> int:
    """``main()``'s exit code; Ctrl-C stops it with one line and exit 130 (as a shell reports
    SIGINT), not a KeyboardInterrupt traceback. The benchmarks write their result file at the
    end, so nothing half-made is left behind."""
    try:
        return int(main() or 0)
    except KeyboardInterrupt:
        print(f"\n{name}: stopped by Ctrl-C; no result written", file=sys.stderr, flush=True)
        return 130
