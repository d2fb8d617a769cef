"""Fixtures shared by the test suites: the native build and a harness that runs programs under the
real shim (libgpushare.so) in front of a stand-in CUDA driver, with or without a live scheduler.

There is no GPU in CI. ``native/tests/fake_libcuda.c`` is built as ``libcuda.so.1`` (and, with
-DGPUSHARE_FAKE_NVML, as ``libnvidia-ml.so.1``) into a directory put on LD_LIBRARY_PATH; the shim
finds it as the "real" driver. ``native/tests/cudart_like.c`` reaches the driver the way the CUDA
runtime does (dlopen + cuGetProcAddress_v2); ``cudart_like_direct`` is the same program linked
against libcuda (the exported-symbol door). Both print one JSON object per line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# The fast and slow tiers and the run over every core (pytest-xdist): tests/tiers.py.
from tests.tiers import pytest_cmdline_main, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "native"
NATIVE_TESTS = NATIVE / "tests"


# ---------------------------------------------------------------------------------------------
# Signals: every process the tests start begins with the default dispositions
# ---------------------------------------------------------------------------------------------

# The signals the tests send to programs they start (tests/native/test_quit_signals.py, the
# scheduler's SIGHUP reload, Ctrl-C of `gpushare status --watch`, ...).
SIGNALS_SENT = (
    signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM, signal.SIGXCPU, signal.SIGABRT,
    signal.SIGSEGV, signal.SIGUSR1, signal.SIGUSR2,
)  # fmt: skip


def _ignored_here(signum: int, frame: Any) -> None:
    """Stands in for SIG_IGN in the test process itself (see restore_default_signals)."""


def restore_default_signals() -> list[signal.Signals]:
    """A test run started from a background job (``cmd &`` in a script, a CI wrapper) inherits
    SIGINT and SIGQUIT as ignored (``nohup``: SIGHUP), and an ignored disposition survives fork
    and exec: every program the tests start would ignore the signals the tests send it, unlike
    the same run from a terminal. A handled signal, on the other hand, is reset to SIG_DFL by
    exec. So where one of SIGNALS_SENT is ignored here, it gets a handler that does nothing: this
    process goes on ignoring it, and everything it starts (the tests' programs, and what a Jupyter
    server or a scheduler starts in turn) begins with the default disposition. Python's
    ``restore_signals`` resets only SIGPIPE and SIGXFSZ; a ``preexec_fn`` would run Python
    between fork and exec, which is unsafe beside the tests' reader threads. Returns the signals
    changed."""
    changed = []
    for sig in SIGNALS_SENT:
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, _ignored_here)
            changed.append(sig)
    return changed


__all__ = ["pytest_cmdline_main", "pytest_collection_modifyitems"]  # hooks: tests/tiers.py


def pytest_configure(config: pytest.Config) -> None:
    restore_default_signals()


def _load_build_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpushare_native_build", NATIVE / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------


@dataclass
class NativeBuild:
    """Where the session's native artefacts are."""

    root: Path
    fake_dir: Path  # libcuda.so.1 and libnvidia-ml.so.1 (the stand-ins)
    cudart_like: Path
    cudart_like_direct: Path
    shim: Path | None
    shim_error: str | None

    def require_shim(self) -> Path:
        if self.shim is None:
            pytest.skip(self.shim_error or "libgpushare.so is not built")
        return self.shim


@pytest.fixture(scope="session")
def native_build(tmp_path_factory: pytest.TempPathFactory) -> NativeBuild:
    build = _load_build_module()
    root = tmp_path_factory.mktemp("native")
    fake_dir = root / "driver"
    fake = [NATIVE_TESTS / "fake_libcuda.c"]
    build.build_shared(fake, fake_dir / "libcuda.so.1")
    build.build_shared(fake, fake_dir / "libnvidia-ml.so.1", ["-DGPUSHARE_FAKE_NVML"])
    program = [NATIVE_TESTS / "cudart_like.c"]
    cudart_like = build.build_program(program, root / "bin" / "cudart_like", ["-lm"])
    direct = build.build_program(
        program,
        root / "bin" / "cudart_like_direct",
        [
            "-DCUDART_LIKE_DIRECT",
            f"-L{fake_dir}",
            "-l:libcuda.so.1",
            f"-Wl,-rpath,{fake_dir}",
            "-lm",
        ],
    )
    shim: Path | None = None
    error: str | None = None
    if not build.shim_sources():
        error = "the shim's sources (native/src/<room>/*.c) are not there"
    else:
        try:
            shim = build.build_shim(root / "lib" / "libgpushare.so")
        except (subprocess.CalledProcessError, SystemExit) as exc:
            pytest.fail(f"libgpushare.so does not build: {exc}", pytrace=False)
    return NativeBuild(root, fake_dir, cudart_like, direct, shim, error)


@pytest.fixture(scope="session")
def hooked_exports() -> frozenset[str]:
    """The exported names the shim hooks, read from native/src/base/hooks.def through the
    preprocessor, so the tests follow the table the shim is built from."""
    build = _load_build_module()
    source = (
        "#define GS_GATED(name, ...) GS_HOOK name\n"
        "#define GS_CUSTOM(name, ...) GS_HOOK name\n"
        '#include "base/hooks.def"\n'
    )
    out = subprocess.run(
        [*build.compiler(), "-E", "-P", f"-I{build.SRC}", "-x", "c", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=True,
    )
    names = frozenset(re.findall(r"GS_HOOK\s+(\w+)", out.stdout))
    assert "cuMemAlloc_v2" in names and "cuLaunchKernel_ptsz" in names, out.stdout[:2000]
    return names


# ---------------------------------------------------------------------------------------------
# Running programs
# ---------------------------------------------------------------------------------------------


def parse_events(stdout: str) -> list[dict[str, Any]]:
    events = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


@dataclass
class Run:
    """A finished program: exit code, output, and its JSON lines."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.events:
            self.events = parse_events(self.stdout)

    def describe(self) -> str:
        return (
            f"command: {' '.join(self.args)}\nexit code: {self.returncode}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )

    def all(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    def event(self, name: str) -> dict[str, Any]:
        found = self.all(name)
        assert found, f"no {name!r} event\n{self.describe()}"
        return found[0]

    def last(self, name: str) -> dict[str, Any]:
        found = self.all(name)
        assert found, f"no {name!r} event\n{self.describe()}"
        return found[-1]

    @property
    def stats(self) -> dict[str, Any]:
        stats = self.last("stats")["stats"]
        assert stats is not None, f"the stand-in driver's stats are missing\n{self.describe()}"
        return stats

    def calls(self, symbol: str) -> int:
        return int(self.stats["calls"].get(symbol, 0))

    @property
    def shim_lines(self) -> list[str]:
        """The shim's own stderr lines (each starts with ``gpushare:``)."""
        return [line for line in self.stderr.splitlines() if line.startswith("gpushare:")]

    def ok(self) -> Run:
        assert self.returncode == 0, self.describe()
        assert self.last("exit")["rc"] == 0, self.describe()
        return self


class Proc:
    """A program running in the background; its JSON lines are collected as they come."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.events: list[dict[str, Any]] = []
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        assert self.popen.stdout
        for line in self.popen.stdout:
            with self._cond:
                self._stdout.append(line)
                if line.startswith("{"):
                    with contextlib.suppress(json.JSONDecodeError):
                        self.events.append(json.loads(line))
                self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.popen.stderr
        for line in self.popen.stderr:
            with self._cond:
                self._stderr.append(line)
                self._cond.notify_all()

    @property
    def stderr(self) -> str:
        with self._cond:
            return "".join(self._stderr)

    def describe(self) -> str:
        with self._cond:
            return (
                f"command: {' '.join(self.args)}\nexit code: {self.popen.poll()}\n"
                f"stdout:\n{''.join(self._stdout)}\nstderr:\n{''.join(self._stderr)}"
            )

    def wait_event(self, name: str, timeout: float = 30.0, where: Any = None) -> dict[str, Any]:
        """The first event called ``name`` (matching ``where(event)`` when given)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events:
                    if e.get("event") == name and (where is None or where(e)):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._readers_alive()):
                    raise AssertionError(
                        f"no {name!r} event within {timeout}s\n{self.describe_unlocked()}"
                    )
                self._cond.wait(min(left, 0.1))

    def wait_stderr(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while text not in "".join(self._stderr):
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._readers_alive()):
                    raise AssertionError(
                        f"{text!r} not on stderr within {timeout}s\n{self.describe_unlocked()}"
                    )
                self._cond.wait(min(left, 0.1))

    def _readers_alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def describe_unlocked(self) -> str:
        return (
            f"command: {' '.join(self.args)}\nexit code: {self.popen.poll()}\n"
            f"stdout:\n{''.join(self._stdout)}\nstderr:\n{''.join(self._stderr)}"
        )

    def finish(self, timeout: float = 60.0) -> Run:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout}s\n{self.describe()}") from None
        for t in self._threads:
            t.join(10)
        with self._cond:
            return Run(
                self.args,
                self.popen.returncode,
                "".join(self._stdout),
                "".join(self._stderr),
                list(self.events),
            )

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)


# ---------------------------------------------------------------------------------------------
# The scheduler, as an operator starts it
# ---------------------------------------------------------------------------------------------


class SchedulerProc:
    """``python -m jupyter_gpushare scheduler`` in a subprocess, its log in a file."""

    def __init__(
        self,
        socket_path: Path,
        log_path: Path,
        pool: str,
        quantum: float,
        env: dict[str, str] | None = None,
        nvml: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.socket_path = socket_path
        self.log_path = log_path
        self.pool = pool
        self.quantum = quantum
        self.extra_env = env or {}  # e.g. the stand-in NVML on LD_LIBRARY_PATH, with nvml=True
        self.nvml = nvml
        self.extra_args = extra_args
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def args(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "jupyter_gpushare",
            "scheduler",
            "--socket",
            str(self.socket_path),
            # "": the default pool, the device's total less pool_reserve (--reserve)
            *(["--pool", self.pool] if self.pool else []),
            "--quantum",
            str(self.quantum),
            "--log-level",
            "DEBUG",
            *([] if self.nvml else ["--no-nvml"]),
            # The node's host budget ("auto" reads this machine's memory) only where a test
            # asks for it: staging then follows every block, as the tests expect.
            *([] if "--host-budget" in self.extra_args else ["--host-budget", "0"]),
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0) -> SchedulerProc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
        env.pop("LD_PRELOAD", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(self.extra_env)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {time.time():.3f}: {' '.join(self.args)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"the scheduler exited ({self.popen.returncode}):\n{self.log}")
            if self.socket_path.exists() and self._connectable():
                return self
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"the scheduler's socket did not appear in {timeout}s:\n{self.log}")

    def _connectable(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.socket_path))
            return True
        except OSError:
            return False
        finally:
            s.close()

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, text: str, timeout: float = 30.0, after: int = 0) -> str:
        """Wait until ``text`` is in the log (past character ``after``); return the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log
            if text in log[after:]:
                return log
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the scheduler log within {timeout}s:\n{self.log}")

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare",
                "status",
                "--json",
                "--socket",
                str(self.socket_path),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert out.returncode == 0, f"gpushare status failed:\n{out.stdout}\n{out.stderr}"
        return json.loads(out.stdout)

    def kill(self) -> None:
        """SIGKILL: the scheduler dies without cleaning up."""
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# ---------------------------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------------------------

MiB = 1 << 20
GiB = 1 << 30


class Harness:
    """Runs the test programs under the shim; everything it starts is stopped at teardown."""

    def __init__(self, build: NativeBuild, tmp: Path, sock_dir: Path) -> None:
        self.build = build
        self.tmp = tmp
        self.sock_dir = sock_dir
        self.procs: list[Proc] = []
        self.schedulers: list[SchedulerProc] = []
        # No scheduler listens here unless a test starts one.
        self.socket_path = sock_dir / "scheduler.sock"
        # One card for every program of the test (GPUSHARE_FAKE_CARD_FILE): their memory
        # together is what the stand-in driver refuses past the device's total, as a real card
        # does (tests/native/card_file.py reads it). Beside the sockets, so that a test that
        # opens that directory to other users opens the card to them too.
        self.card_file = sock_dir / "card"

    def env(
        self, shim: bool = True, extra: dict[str, str] | None = None, **gpushare: Any
    ) -> dict[str, str]:
        """The environment of a program: the stand-in driver on LD_LIBRARY_PATH, the shim
        preloaded (unless ``shim=False``), the test's card file (GPUSHARE_FAKE_CARD_FILE; an
        empty value in ``extra`` turns it off), GPUSHARE_<KEY>=value for each keyword argument."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
        env.pop("LD_PRELOAD", None)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(self.build.fake_dir), os.environ.get("LD_LIBRARY_PATH")])
        )
        if shim:
            env["LD_PRELOAD"] = str(self.build.require_shim())
        env["GPUSHARE_SOCKET"] = str(self.socket_path)
        env["GPUSHARE_LOG"] = "info"
        env["GPUSHARE_FAKE_CARD_FILE"] = str(self.card_file)
        for key, value in gpushare.items():
            env[f"GPUSHARE_{key.upper()}"] = str(value)
        env.update(extra or {})
        return env

    def program(self, direct: bool = False) -> str:
        return str(self.build.cudart_like_direct if direct else self.build.cudart_like)

    def run(
        self,
        *args: Any,
        shim: bool = True,
        direct: bool = False,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        extra: dict[str, str] | None = None,
        **gpushare: Any,
    ) -> Run:
        argv = [self.program(direct), *map(str, args)]
        e = env if env is not None else self.env(shim=shim, extra=extra, **gpushare)
        try:
            out = subprocess.run(argv, env=e, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{' '.join(argv)} still running after {timeout}s\nstdout:\n{exc.stdout}\n"
                f"stderr:\n{exc.stderr}"
            ) from None
        return Run(argv, out.returncode, out.stdout, out.stderr)

    def spawn(
        self,
        *args: Any,
        shim: bool = True,
        direct: bool = False,
        env: dict[str, str] | None = None,
        extra: dict[str, str] | None = None,
        **gpushare: Any,
    ) -> Proc:
        argv = [self.program(direct), *map(str, args)]
        return self.spawn_command(
            argv, env if env is not None else self.env(shim=shim, extra=extra, **gpushare)
        )

    def spawn_command(self, argv: list[str], env: dict[str, str]) -> Proc:
        """Start any program in the background (killed at the test's end), e.g. a Python kernel
        stand-in; ``spawn`` runs the test program."""
        proc = Proc(argv, env)
        self.procs.append(proc)
        return proc

    def scheduler(
        self,
        pool: str = "1GiB",
        quantum: float = 2.0,
        fake_devices: int = 0,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> SchedulerProc:
        """Start a scheduler on this harness's socket (what GPUSHARE_SOCKET points at).

        ``fake_devices``: discover that many GPUs through NVML, the stand-in libnvidia-ml (0: no
        NVML; devices are learnt from the shims). ``args``: more command-line options; ``env``:
        more environment (the stand-in driver's settings for the scheduler's own calls; with
        ``GPUSHARE_FAKE_CARD_FILE=str(self.card_file)`` the stand-in NVML answers for the test's
        whole card: its memory, and each process's, nvmlDeviceGetComputeRunningProcesses)."""
        log = self.tmp / f"scheduler-{len(self.schedulers)}.log"
        env = dict(env or {})
        if fake_devices:
            env |= {
                "LD_LIBRARY_PATH": str(self.build.fake_dir),
                "GPUSHARE_FAKE_DEVICES": str(fake_devices),
            }
        sched = SchedulerProc(
            self.socket_path, log, pool, quantum, env, nvml=bool(fake_devices), extra_args=args
        )
        self.schedulers.append(sched)
        return sched.start()

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for sched in self.schedulers:
            sched.stop()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short directory under /tmp for Unix sockets: their paths are limited to 107 bytes, and
    pytest's tmp_path can be longer."""
    path = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def harness(native_build: NativeBuild, tmp_path: Path, sock_dir: str) -> Iterator[Harness]:
    h = Harness(native_build, tmp_path, Path(sock_dir))
    try:
        yield h
    finally:
        h.close()
        for sched in h.schedulers:
            log = sched.log
            if log:
                # Kept next to the test's other files for a failing run's report.
                (tmp_path / "scheduler-final.log").write_text(log)


@pytest.fixture(scope="session")
def session_harness(
    native_build: NativeBuild, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    """A harness shared by a session's reference runs (never with a scheduler)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="gsn-", dir="/tmp"))
    h = Harness(native_build, tmp_path_factory.mktemp("session"), sock_dir)
    try:
        yield h
    finally:
        h.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
