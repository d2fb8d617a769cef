"""Worker processes driven over pipes (``bench.worker serve``): send a command, read the answer."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from typing import Any

from .common import ROOT


class WorkerProc:
    """One ``python -m bench.worker serve`` process; stdout lines arrive on a queue (a thread)."""

    def __init__(
        self, env: dict[str, str], name: str = "worker", args: tuple[str, ...] = ("serve",)
    ) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self._pumps = [
            threading.Thread(target=self._pump, daemon=True),
            threading.Thread(target=self._pump_err, daemon=True),
        ]
        for pump in self._pumps:
            pump.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-200]

    def exit_report(self, timeout: float = 10.0) -> str:
        """How an ended process ended: its exit status (a negative one: the signal that killed
        it) and the last lines of its stderr, read to the end: the pipe is drained once the
        process is gone, and reading ``stderr`` before that can miss all of it."""
        rc = self.proc.wait(timeout)
        for pump in self._pumps:
            pump.join(timeout)
        return f"exit status {rc}\n" + "".join(self.stderr[-20:])

    def read(self, timeout: float = 600.0) -> dict[str, Any]:
        """The next JSON line; skips anything else the process printed."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no answer in {timeout} s") from None
            if line is None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.wait()}):\n{''.join(self.stderr[-30:])}"
                )
            line = line.strip()
            if line.startswith("{"):
                return dict(json.loads(line))

    def send(self, op: str, **kwargs: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def call(
        self, op: str, timeout: float = 600.0, check: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        self.send(op, **kwargs)
        ans = self.read(timeout)
        if check and not ans.get("ok", False):
            raise RuntimeError(f"{self.name}: {op} failed: {ans.get('error')}")
        return ans

    def write_line(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
