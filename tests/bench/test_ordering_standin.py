"""A short cell overtakes a long one through the real scheduler and shims (stand-in driver).

Two replay users (bench/replay.py's workers on the stand-in driver, under the real shim, with a
real scheduler subprocess): a long cell starts, and a short cell arrives once the long one has
had more GPU time than the first level. Under the interactive ordering the short cell goes
through at once and the long one waits at its launch gate until the short one ends, with its
memory left in place; under "fair" both run (the stand-in's kernels do not slow each other).
"""

from __future__ import annotations

import re

from bench import replay
from bench.common import GiB
from bench.trace import TraceConfig, User
from bench.worker import StandinWorker

LONG, SHORT = 4.0, 0.6  # solo seconds of the two cells
SHORT_ARRIVES = 2.0  # by then the long cell has had ~1.5 s of GPU time: above level 0 (1 s)
# How long past the trace's horizon the cells may take to end: the replay returns as soon as
# they have; a loaded 2-core machine has made the 4 s cell take 40 s.
GRACE = 120.0


def play(native_build, tmp_path, monkeypatch, ordering: str) -> tuple[dict, dict, str]:
    monkeypatch.setenv("GPUSHARE_LIBRARY", str(native_build.require_shim()))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(native_build.fake_dir))
    monkeypatch.setenv("GPUSHARE_BENCH_BACKEND", "standin")
    monkeypatch.setenv("GPUSHARE_FAKE_DEVICE_TOTAL", "80GiB")
    users = [
        User("ulong", GiB, cells=[{"think": 0.5, "gpu": LONG}]),
        User("ushort", GiB, cells=[{"think": SHORT_ARRIVES, "gpu": SHORT}]),
    ]
    cal = {"t_iter": StandinWorker.T_ITER, "touch_s_per_gib": 0.0}
    mode = "gpushare" if ordering == "interactive" else "gpushare-fair"
    rec = replay._play(
        mode, users, TraceConfig(users=2, horizon=3.0), cal, 12 * GiB, GRACE, tmp_path, print
    )
    cells = {c["user"]: c for c in rec["cells"]}
    assert all(c["ok"] for c in cells.values()), cells
    logs = "".join(p.read_text() for p in tmp_path.glob("scheduler-*.log"))
    return cells["ulong"], cells["ushort"], logs


def latency(c: dict) -> float:
    return c["end"] - c["arrival"]


def cell_turns(logs: str) -> list[tuple[str, str]]:
    """(what, client) for each grant, revoke, release and leave in the scheduler's log while
    the cells run: after each user's ready-time turn (a grant, then a revoke "released by
    request" and its release)."""
    turns = re.findall(r"\] (grant|revoke|release|leave) client=(\w+)(.*)", logs)
    # each user's ready-time revoke, then its release: the two users' may interleave
    readies = [(i, t[1]) for i, t in enumerate(turns) if "released by request" in t[2]]
    done = max(
        next(j for j in range(i, len(turns)) if turns[j][:2] == ("release", who))
        for i, who in readies
    )
    return [(what, who) for what, who, _ in turns[done + 1 :]]


def test_interactive_the_short_cell_overtakes_and_the_long_one_pauses(
    native_build, tmp_path, monkeypatch
):
    long_, short, logs = play(native_build, tmp_path, monkeypatch, "interactive")
    assert short["arrival"] > long_["arrival"] and short["end"] < long_["end"]
    assert latency(long_) > LONG + 0.8 * SHORT  # it waited at its gate while the short one ran
    paused = re.findall(r"revoke client=ulong evict=(\d).*reason='paused: shorter cells", logs)
    assert paused and set(paused) == {"0"}, logs[-3000:]  # paused, never evicted
    assert not re.search(r"evicted client=ulong", logs)
    # Through the gate at once, a pause and not a wait: the short cell was granted the device
    # before the long one had given it back, and the long one resumed only after that.
    turns = cell_turns(logs)
    assert turns[0] == ("grant", "ulong"), turns
    short_grant = turns.index(("grant", "ushort"))
    assert short_grant < turns.index(("release", "ulong")), turns
    assert ("grant", "ulong") in turns[short_grant:], turns


def test_fair_both_run_and_nobody_pauses(native_build, tmp_path, monkeypatch):
    long_, short, logs = play(native_build, tmp_path, monkeypatch, "fair")
    assert "not recognized" not in logs
    assert "paused: shorter cells first" not in logs
    # Both ran at once: the short cell arrived and ended inside the long one and was granted
    # the device while the long one held it, from its grant to its end, without a revoke.
    assert long_["start"] < short["arrival"] and short["end"] < long_["end"], (long_, short)
    turns = cell_turns(logs)
    assert [t for t in turns if t[1] == "ulong"] == [("grant", "ulong"), ("leave", "ulong")], turns
    assert turns.index(("grant", "ulong")) < turns.index(("grant", "ushort")), turns
    assert turns.index(("grant", "ushort")) < turns.index(("leave", "ulong")), turns
