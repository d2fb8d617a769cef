"""The wait, in the cell (jupyter_gpushare/waitline.py): its texts, its steps on a fake clock, and
a real kernel under the shim whose cell waits for another process's turn on the stand-in driver."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from provisioner_helpers import CONTEXT, GPU_PRELUDE, MiB, async_wait_for, execute

from jupyter_gpushare.shim import library_path, shim_environment
from jupyter_gpushare.waitline import (
    MIME_TYPE,
    RELEASING_TEXT,
    WaitLine,
    got_text,
    ordinal,
    wait_text,
)

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# Loading the extension

#: Loads the magic as ipykernel does (a shell with a kernel and events), then reports what the
#: start cost: whether cffi was imported, whether the wait line's thread runs, and what the
#: first status read (the thread's first poll, or %gpushare) finds.
_LOAD_EXTENSION = """
import json, sys, threading
from jupyter_gpushare import magic, shim

class Events:
    def register(self, *args):
        pass

class Shell:
    kernel = object()
    events = Events()
    def register_magics(self, magics):
        pass

magic.load_ipython_extension(Shell())
def imported():
    return sorted(m for m in ("cffi", "pycparser") if m in sys.modules)

report = {
    "imported": imported(),
    "wait_line": any(t.name == "gpushare-wait-line" for t in threading.enumerate()),
}
status = shim.read_status()
report["state"] = status and status["state"]
report["imported_by_the_read"] = imported()
print(json.dumps(report))
"""


def _load_extension(env: dict[str, str]) -> dict[str, Any]:
    env = {**env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_EXTENSION], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_the_magic_does_not_load_cffi() -> None:
    """The kernel start path: cffi's import and the parse of the status API's declarations take
    about 13 ms in a kernel, which every kernel's start paid when the wait line asked for the
    status to decide whether to start. It now checks for the shim with a symbol lookup; the
    first status read loads cffi, after the kernel is ready."""
    env = shim_environment(
        os.environ, socket="/nonexistent/s.sock", client_id="probe", library=library_path()
    )
    under_shim = _load_extension(env)
    assert under_shim == {
        "imported": [],
        "wait_line": True,
        "state": "inactive",
        "imported_by_the_read": ["cffi", "pycparser"],  # the first read pays it
    }

    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    outside = _load_extension(plain)
    # No shim: no thread, and the status read answers None without loading cffi either.
    assert outside == {
        "imported": [],
        "wait_line": False,
        "state": None,
        "imported_by_the_read": [],
    }


# ---------------------------------------------------------------------------------------------
# Texts


def test_ordinals() -> None:
    words = [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)]
    expected = [
        "1st",
        "2nd",
        "3rd",
        "4th",
        "11th",
        "12th",
        "13th",
        "21st",
        "22nd",
        "101st",
        "111th",
    ]
    assert words == expected


def _holder(**over: Any) -> dict[str, Any]:
    return (
        {"id": "h1", "user": "alice", "state": "running", "held_seconds": 18.0}
        | {
            "quantum_seconds": 30.0,
            "past_quantum_seconds": 0.0,
            "revoking_seconds": None,
        }
        | over
    )


def test_wait_texts_for_each_reason() -> None:
    waiting = {"state": "waiting", "evicted_bytes": 0}
    queue = {"state": "waiting", "queue_position": 2, "wait": {"reason": "queue"}}
    queue["wait"]["holders"] = [_holder()]
    # Another user's holder: its label is not visible (docs/protocol.md), its user name is.
    assert (
        wait_text(waiting, queue, {"clients": []}, "bob")
        == "Waiting for the GPU: 2nd in line, behind alice's kernel (turn ends in ~12 s)"
    )
    # Where the viewer may see the holder (an admin, or their own other kernel) its label shows.
    device = {"clients": [{"id": "h1", "user": "alice", "label": "/home/alice/train.ipynb"}]}
    assert "behind alice's train.ipynb (turn ends in ~12 s)" in wait_text(waiting, queue, device)
    assert "behind your train.ipynb" in wait_text(waiting, queue, device, me="alice")

    releasing = {
        "state": "waiting",
        "queue_position": 1,
        "wait": {"reason": "releasing", "holders": [_holder(state="revoking", revoking_seconds=4)]},
    }
    text = wait_text(waiting, releasing, None, "bob")
    assert text == (
        "Waiting for the GPU: 1st in line, behind alice's kernel, which is finishing its GPU "
        "work (asked to release 4 s ago)"
    )
    past = {"state": "waiting", "queue_position": 1, "wait": {"reason": "past_quantum"}}
    past["wait"]["holders"] = [_holder(held_seconds=40.0)]
    assert wait_text(waiting, past, None).endswith("behind alice's kernel (its turn is over)")

    memory = {"state": "waiting", "wait": {"reason": "memory", "holders": []}}
    assert wait_text(waiting, memory, None) == (
        "Waiting for the GPU: moving another kernel's memory to host memory"
    )
    memory["wait"]["moving_bytes"] = 14 << 30
    assert "moving 14.00 GiB of another kernel's memory" in wait_text(waiting, memory, None)
    assert wait_text({"state": "asleep"}, None, None) == "Waiting for the GPU: waking from sleep"
    assert wait_text({"state": "6"}, None, None) == "Waiting for the GPU: waking from sleep"
    granted = {"state": "running"}
    assert wait_text(dict(waiting, evicted_bytes=6 << 30), granted, None) == (
        "Got the GPU: restoring 6.00 GiB of this kernel's memory"
    )
    assert wait_text(waiting, None, None) == "Waiting for the GPU"
    shorter = {"state": "waiting", "wait": {"reason": "shorter_first", "holders": [_holder()]}}
    assert wait_text(waiting, shorter, None) == (
        "Waiting for the GPU: paused while shorter cells run (your memory stays on the GPU)"
    )
    recovering = {"state": "waiting", "wait": {"reason": "recovering", "holders": []}}
    assert "scheduler restarted" in wait_text(waiting, recovering, None)
    # The node's host budget holds the move back: the cell says so in the status's words.
    full = "the node's host memory is full: 96.00 GiB of its 100.00 GiB for moved memory held by 2"
    host = {"state": "waiting", "wait": {"reason": "host_memory", "text": full, "holders": []}}
    assert wait_text(waiting, host, None) == f"Waiting for the GPU: {full}"


def test_got_texts() -> None:
    assert got_text(14.23, 0, None) == "Got the GPU after 14.2 s"
    assert got_text(14.23, 6 << 30, 0.21) == "Got the GPU after 14.2 s (restored 6.00 GiB in 0.2 s)"
    assert got_text(3.0, 1 << 30, None) == "Got the GPU after 3.0 s (restored 1.00 GiB)"


# ---------------------------------------------------------------------------------------------
# Steps, on a fake clock


class Script:
    """A shim status sequence and a scheduler that answers from a table, on a clock we move."""

    def __init__(self) -> None:
        self.now = 100.0
        self.status: dict[str, Any] = {"state": "holding", "evicted_bytes": 0}
        self.entry: dict[str, Any] | None = None
        self.published: list[tuple[dict[str, Any], bool]] = []
        self.asked = 0

    def view(self, _status: dict[str, Any]) -> tuple[dict[str, Any] | None, None]:
        self.asked += 1
        return self.entry, None

    def line(self, **kw: Any) -> WaitLine:
        return WaitLine(
            read_status=lambda: dict(self.status),
            scheduler_view=self.view,
            publish=lambda content, update: self.published.append((content, update)),
            clock=lambda: self.now,
            **kw,
        )

    def wait(self, seconds: float, **status: Any) -> None:
        self.now += 0.1
        self.status = {"state": "waiting", "current_wait_seconds": seconds} | status


def test_short_waits_and_cells_that_do_not_wait_show_nothing() -> None:
    s = Script()
    line = s.line()
    for _ in range(5):
        line.poll()
    s.wait(0.5, evicted_bytes=0)
    line.poll()
    s.status = {"state": "holding", "evicted_bytes": 0}
    line.poll()
    assert s.published == [] and s.asked == 0


def test_a_wait_is_one_display_updated_then_the_got_line() -> None:
    s = Script()
    line = s.line()
    s.entry = {"state": "waiting", "queue_position": 2, "wait": {"reason": "queue"}}
    s.entry["wait"]["holders"] = [_holder()]
    s.wait(0.4, evicted_bytes=6 << 30)
    line.poll()
    assert s.published == []
    s.wait(1.2, evicted_bytes=6 << 30)
    line.poll()
    (first, update), *_ = s.published
    display_id = first["transient"]["display_id"]
    assert not update and display_id
    assert first["data"]["text/plain"] == (
        "Waiting for the GPU: 2nd in line, behind alice's kernel (turn ends in ~12 s)"
    )
    assert first["data"][MIME_TYPE]["phase"] == "waiting"
    assert "var(--jp-warn-color1)" in first["data"]["text/html"]
    # The same text is not sent again; the scheduler is asked at most once a second.
    s.wait(1.3, evicted_bytes=6 << 30)
    line.poll()
    assert len(s.published) == 1 and s.asked == 1
    # The holder's turn goes on: a new text, as an update of the same display.
    s.now += 1.0
    s.entry["wait"]["holders"] = [_holder(held_seconds=25.0)]
    s.status["current_wait_seconds"] = 2.4
    line.poll()
    content, update = s.published[-1]
    assert update and content["transient"]["display_id"] == display_id
    assert content["data"]["text/plain"].endswith("(turn ends in ~5 s)")
    # Granted: the scheduler says running while the shim restores (the wait is not over yet).
    s.now += 1.0
    s.entry = {"state": "running"}
    s.status["current_wait_seconds"] = 3.5
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"] == (
        "Got the GPU: restoring 6.00 GiB of this kernel's memory"
    )
    s.now += 0.25
    s.status = {"state": "holding", "evicted_bytes": 0} | _restored(1, 6 << 30, 0.123)
    line.poll()
    content, update = s.published[-1]
    assert update and content["transient"]["display_id"] == display_id
    # The restore as the shim reported it (its RESTORED), not a guess from the counters.
    assert content["data"]["text/plain"] == "Got the GPU after 3.5 s (restored 6.00 GiB in 0.1 s)"
    assert content["data"][MIME_TYPE] == {
        "phase": "granted",
        "text": content["data"]["text/plain"],
        "seconds": 3.5,
    }
    # The next wait is a new display.
    count = len(s.published)
    s.wait(2.0, evicted_bytes=0)
    line.poll()
    assert len(s.published) == count + 1
    new_content, new_update = s.published[-1]
    assert not new_update and new_content["transient"]["display_id"] != display_id


def _restored(count: int, nbytes: int, seconds: float) -> dict[str, Any]:
    """The shim status's record of its RESTOREDs: how many, and the last one's figures."""
    return {"restores": count, "last_restore_bytes": nbytes, "last_restore_seconds": seconds}


def test_memory_made_while_waiting_is_not_called_restored() -> None:
    """Deferred backing: 700 MiB allocated while the kernel waited count as on the host until the
    grant backs them, and the grant's RESTORED moved 0 bytes: the line names no restore. A later
    grant that sent no RESTORED at all does not repeat an earlier restore's figures."""
    s = Script()
    s.status = {"state": "idle", "evicted_bytes": 0} | _restored(3, 2 << 30, 0.4)
    line = s.line()
    line.poll()
    s.wait(1.5, evicted_bytes=700 * MiB, **_restored(3, 2 << 30, 0.4))
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"].startswith("Waiting for the GPU")
    s.status = {"state": "holding", "evicted_bytes": 0} | _restored(4, 0, 0.0001)
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"] == "Got the GPU after 1.5 s"
    # Its memory now on the GPU, the next grant restores nothing: the shim sends no RESTORED.
    s.wait(2.5, evicted_bytes=0, **_restored(4, 0, 0.0001))
    line.poll()
    s.status = {"state": "holding", "evicted_bytes": 0} | _restored(4, 0, 0.0001)
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"] == "Got the GPU after 2.5 s"
    # Evicted for real, then restored: the figures of that RESTORED.
    s.wait(3.0, evicted_bytes=700 * MiB, **_restored(4, 0, 0.0001))
    line.poll()
    s.status = {"state": "holding", "evicted_bytes": 0} | _restored(5, 700 * MiB, 0.31)
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"] == (
        "Got the GPU after 3.0 s (restored 700.00 MiB in 0.3 s)"
    )


def test_an_interrupted_wait_says_it_stopped_not_that_it_got_the_gpu() -> None:
    s = Script()
    line = s.line()
    s.wait(2.0, evicted_bytes=0, holding_seconds=7.0)
    line.poll()
    display_id = s.published[0][0]["transient"]["display_id"]
    s.status = {"state": "idle", "evicted_bytes": 0, "holding_seconds": 7.0}  # SIGINT ended it
    line.poll()
    content, update = s.published[-1]
    assert update and content["transient"]["display_id"] == display_id
    assert content["data"]["text/plain"] == "Stopped waiting for the GPU after 2.0 s"
    assert content["data"][MIME_TYPE]["phase"] == "stopped"
    # A turn already over by the next poll (idle again, but it held the GPU meanwhile) is a grant.
    s.wait(3.0, evicted_bytes=0, holding_seconds=7.0)
    line.poll()
    s.status = {"state": "idle", "evicted_bytes": 0, "holding_seconds": 7.5}
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"] == "Got the GPU after 3.0 s"


def test_a_wait_that_begins_during_the_kernels_own_release_is_shown() -> None:
    """A call blocked while the shim still hands the GPU back (state "releasing", its wait
    counting) is a wait like another: the line appears once it passed the threshold, not when the
    release ends. Once the shim waits in line, the scheduler is asked again at once (its entry
    from the release said "revoking"). A release with no call waiting shows nothing, and a wait
    interrupted during the release says it stopped."""
    s = Script()
    line = s.line()
    s.status = {"state": "releasing", "current_wait_seconds": 0.0, "holding_seconds": 9.0}
    line.poll()
    s.wait(0.6, state="releasing", holding_seconds=9.0)
    line.poll()
    assert s.published == []
    s.entry = {"state": "revoking"}
    s.wait(1.1, state="releasing", holding_seconds=9.0)
    line.poll()
    (first, update), *_ = s.published
    assert not update and first["data"]["text/plain"] == RELEASING_TEXT
    assert s.asked == 1
    s.entry = {"state": "waiting", "queue_position": 1, "wait": {"reason": "turn"}}
    s.entry["wait"]["holders"] = [_holder()]
    s.wait(1.3, holding_seconds=9.0)  # released; now in line (0.1 s after the last ask)
    line.poll()
    assert s.asked == 2
    assert s.published[-1][0]["data"]["text/plain"].startswith(
        "Waiting for the GPU: 1st in line, behind alice's kernel"
    )
    s.status = {"state": "holding", "evicted_bytes": 0}
    line.poll()
    assert s.published[-1][0]["data"]["text/plain"] == "Got the GPU after 1.3 s"
    # Interrupted while the release still ran: nothing was held since.
    s.status = {"state": "idle", "holding_seconds": 12.0}
    line.poll()
    count = len(s.published)
    s.wait(1.5, state="releasing", holding_seconds=12.0)
    line.poll()
    s.status = {"state": "releasing", "current_wait_seconds": 0.0, "holding_seconds": 12.0}
    line.poll()
    assert len(s.published) == count + 2
    assert s.published[-1][0]["data"]["text/plain"] == "Stopped waiting for the GPU after 1.5 s"


def test_no_display_outside_a_cell_and_a_pending_quota_is_applied_once() -> None:
    from jupyter_gpushare import waitline

    s = Script()
    applied: list[tuple[str, int]] = []
    line = s.line(
        in_cell=lambda: False,
        apply_quota=lambda status, quota: applied.append((status["client_id"], quota)) or None,
    )
    s.wait(5.0)
    line.poll()
    assert s.published == []
    waitline.set_pending_quota(256 * MiB)
    s.status = {"state": "inactive", "connected": False, "client_id": "k"}
    line.poll()
    assert applied == []  # not registered yet
    s.status = {"state": "holding", "connected": True, "client_id": "k"}
    line.poll()
    line.poll()
    assert applied == [("k", 256 * MiB)]
    refused = s.line(apply_quota=lambda status, quota: "forbidden: over the ceiling")
    waitline.set_pending_quota(1 << 40)
    refused.poll()
    assert s.published[-1][0]["data"]["text/plain"] == (
        "gpushare: cannot set the quota: forbidden: over the ceiling"
    )


# ---------------------------------------------------------------------------------------------
# In a real kernel


async def _run_collecting(kc: Any, code: str, timeout: float = 90.0) -> list[dict[str, Any]]:
    """Run ``code``; every iopub message of the cell (display and update messages included)."""
    msg_id = kc.execute(code)
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        msg = await kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        out.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return out


def _displays(msgs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [
        (
            m["msg_type"],
            m["content"]["transient"].get("display_id", ""),
            m["content"]["data"]["text/plain"],
        )
        for m in msgs
        if m["msg_type"] in ("display_data", "update_display_data")
    ]


def _spawn_train_holder(harness: Any, seconds: float) -> Any:
    """Another process of the same user, labelled train.ipynb, that holds the GPU with 640 MiB
    for ``seconds`` once granted (it and the kernel's 640 MiB do not fit a 1 GiB pool)."""
    return harness.spawn(
        "hold",
        seconds,
        640 * MiB,
        20000,
        client_id="holder",
        context_bytes=CONTEXT,
        idle_seconds=0,
        label="/home/me/train.ipynb",
    )


async def test_a_waiting_cell_shows_the_wait_then_the_grant(harness: Any, kernels: Any) -> None:
    """Another process (same user, labelled train.ipynb) holds the GPU for a few seconds and both
    do not fit the pool: the kernel's cell shows one live line that names the holder, then turns
    into "Got the GPU after N s". A cell that does not wait shows nothing."""
    sched = harness.scheduler(pool="1GiB", quantum=60.0)
    km, kc = await kernels.start()
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(640 << 20)[0], launch(1000), sync())")).ok()
    quiet = await _run_collecting(kc, "print(launch(1000), sync())")
    assert _displays(quiet) == []
    (await execute(kc, "%gpushare release")).ok()

    holder = _spawn_train_holder(harness, 4.0)
    holder.wait_event("first_launch", 30)

    def holder_runs() -> bool:
        return any(
            c["id"] == "holder" and c["state"] == "running"
            for d in sched.status().get("devices", [])
            for c in d.get("clients", [])
        )

    await async_wait_for(holder_runs, timeout=30, what="the holder to hold the GPU")
    started = time.monotonic()
    msgs = await _run_collecting(kc, "print('rc', launch(1000), sync())")
    elapsed = time.monotonic() - started
    shown = _displays(msgs)
    assert shown, msgs
    kinds = [k for k, _, _ in shown]
    assert kinds[0] == "display_data" and set(kinds[1:]) <= {"update_display_data"}, shown
    assert len({d for _, d, _ in shown}) == 1, shown  # one line, updated in place
    first = shown[0][2]
    assert first.startswith("Waiting for the GPU: 1st in line, behind your train.ipynb"), shown
    assert "(turn ends in ~" in first, shown
    last = shown[-1][2]
    # The kernel's 640 MiB had been moved to the host to make room for the holder: the grant
    # restored them, as the shim measured and reported them (its RESTORED).
    assert re.fullmatch(
        r"Got the GPU after \d+\.\d s \(restored 640\.00 MiB in \d+\.\d s\)", last
    ), (shown, sched.log)
    waited = float(last.split("after ")[1].split(" s")[0])
    # The shim's own figure; the test times the cell from its side of the socket. Once, on a
    # loaded machine, the two differed by a little the other way: a margin, not a bound.
    assert 1.0 <= waited <= elapsed + 0.5, (waited, elapsed)
    stdout = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    assert stdout.split() == ["rc", "0", "0"]
    holder.finish(30)
    await asyncio.sleep(0)
    del km


async def test_memory_made_while_waiting_is_backed_not_restored(harness: Any, kernels: Any) -> None:
    """Deferred backing in a real kernel: its 640 MiB are allocated while another process holds
    the GPU, so they get no physical memory until the grant (counted as on the host meanwhile).
    Nothing is copied back at the grant, and the line says so: "Got the GPU after N s" alone."""
    sched = harness.scheduler(pool="1GiB", quantum=60.0)
    _km, kc = await kernels.start()
    holder = harness.spawn(
        "hold", 4.0, 640 * MiB, 20000, client_id="holder", context_bytes=CONTEXT, idle_seconds=0
    )
    holder.wait_event("first_launch", 30)
    made = await execute(
        kc,
        GPU_PRELUDE
        + "\nprint(alloc(640 << 20)[0])"
        + "\nfrom jupyter_gpushare import shim; s = shim.read_status()"
        + "\nprint(s['evicted_bytes'], s['restores'])",
    )
    # Allocated without waiting, and all of it counted off the device: the memory was deferred.
    assert made.ok().stdout.split() == ["0", str(640 * MiB), "0"], made.describe()
    msgs = await _run_collecting(kc, "print('rc', launch(1000), sync())")
    shown = _displays(msgs)
    assert shown and shown[0][2].startswith("Waiting for the GPU: "), shown
    assert re.fullmatch(r"Got the GPU after \d+\.\d s", shown[-1][2]), (shown, sched.log)
    # The grant's RESTORED moved nothing; the shim's record says the same.
    assert re.search(r"restored client=\S+ bytes=0 ", sched.log), sched.log
    probe = (
        "s = shim.read_status(); print(s['restores'], s['last_restore_bytes'], s['evicted_bytes'])"
    )
    assert (await execute(kc, probe)).ok().stdout.split() == ["1", "0", "0"]
    holder.finish(30)


async def test_quota_before_the_first_gpu_call(harness: Any, kernels: Any) -> None:
    """%gpushare quota in a fresh kernel (no GPU call yet) is applied when it registers."""
    harness.scheduler(pool="1GiB")
    _km, kc = await kernels.start({"memory_limit": "128MiB"})
    asked = (await execute(kc, "%gpushare quota 256MiB")).ok()
    assert "128.00 MiB -> 256.00 MiB: applied when this kernel makes its first GPU call" in (
        asked.stdout
    ), asked.describe()
    (await execute(kc, GPU_PRELUDE)).ok()
    probe = "from jupyter_gpushare import shim; print(shim.read_status()['quota_bytes'])"
    for _ in range(100):
        if int((await execute(kc, probe)).ok().stdout) == 256 * MiB:
            break
        await asyncio.sleep(0.1)
    assert int((await execute(kc, probe)).ok().stdout) == 256 * MiB
    fits = (await execute(kc, "print(alloc(200 << 20)[0])")).ok()
    assert fits.stdout.strip() == "0", fits.describe()


async def test_interrupt_stops_the_wait_and_the_line_says_so(harness: Any, kernels: Any) -> None:
    """Interrupt still works with the wait line's thread running, and the line ends as
    "Stopped waiting", not as a grant."""
    harness.scheduler(pool="1GiB", quantum=60.0)
    holder = harness.spawn(
        "hold", 120.0, 640 * MiB, 20000, client_id="holder", context_bytes=CONTEXT, idle_seconds=0
    )
    holder.wait_event("first_launch", 30)
    km, kc = await kernels.start()
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(640 << 20)[0])")).ok()
    cell = asyncio.ensure_future(_run_collecting(kc, "rc = launch(1000)\nprint('launched', rc)"))
    await asyncio.sleep(2.5)  # past the line's 1 s
    assert not cell.done()
    interrupted = time.monotonic()
    await km.interrupt_kernel()
    msgs = await asyncio.wait_for(cell, 30)
    assert time.monotonic() - interrupted < 3.0
    errors = [m["content"]["ename"] for m in msgs if m["msg_type"] == "error"]
    assert errors == ["KeyboardInterrupt"], msgs
    shown = _displays(msgs)
    assert shown[0][2].startswith("Waiting for the GPU: "), shown
    assert re.fullmatch(r"Stopped waiting for the GPU after \d+\.\d s", shown[-1][2]), shown
    assert len({d for _, d, _ in shown}) == 1, shown
    holder.kill()


#: The cell tells the test it runs, then waits (on the CPU) until its kernel is revoked; its next
#: launch then finds the gate closed while the shim still hands the GPU back.
_LAUNCH_DURING_THE_RELEASE = """
import json, time
from jupyter_gpushare import shim
open(MARK, "w").close()
deadline = time.time() + 60
while shim.read_status()["state"] != "releasing" and time.time() < deadline:
    time.sleep(0.005)
blocked = time.time()
rc = launch(1000), sync()
print(json.dumps({"blocked": blocked, "rc": rc}))
"""


async def test_a_call_blocked_while_its_kernel_releases_shows_the_line_within_a_second(
    harness: Any, kernels: Any, tmp_path: Path
) -> None:
    """The H100 failure at 1c5b1bd (docs/gpu-verification.md): B's next launch blocked while B's
    own shim was still handing the GPU back (revoked, its fresh 14 GiB moving to host memory for
    about 4 s). The shim counts a wait from the moment a call blocks, but (1) its state said
    "releasing", not "waiting", and the line waited for "waiting"; (2) a status read waited for
    the eviction to end (the engine's lock). The line appeared only ~1 s after the release had
    ended: its figure exceeded the span of its updates by 4.2 s. Here another process's request
    revokes the kernel (its quantum is over), and the stand-in makes the eviction last 3 s and
    the restore 1.5 s. The line must appear about a second into the wait, as the docs say,
    while the release still runs; then name the holder; then the grant, with the whole wait."""
    sched = harness.scheduler(pool="1GiB", quantum=3.0)
    slow = kernels.kernel_env(
        GPUSHARE_FAKE_UNMAP_DELAY_US="3000000", GPUSHARE_FAKE_MAP_DELAY_US="1500000"
    )
    _km, kc = await kernels.start(env=slow)
    (await execute(kc, GPU_PRELUDE + "\nprint(alloc(640 << 20)[0], launch(1000), sync())")).ok()
    # Past its quantum, the kernel is revoked at once for a waiter, and that waiter's 2 s are
    # less than its own quantum: one handoff each way (a quantum shorter than the slow restore
    # would hand the GPU back and forth).
    await asyncio.sleep(3.5)
    mark = tmp_path / "running"
    cell = asyncio.ensure_future(
        _run_collecting(kc, f"MARK = {str(mark)!r}\n" + _LAUNCH_DURING_THE_RELEASE)
    )
    await async_wait_for(mark.exists, timeout=60, what="the kernel's cell")
    holder = _spawn_train_holder(harness, 2.0)
    msgs = await asyncio.wait_for(cell, 90)
    stdout = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    record = json.loads(stdout.strip().splitlines()[-1])
    assert record["rc"] == [0, 0], (stdout, sched.log)
    # (the kernel's clock when it sent each version, its text)
    shown = [
        (m["header"]["date"].timestamp(), m["content"]["data"]["text/plain"])
        for m in msgs
        if m["msg_type"] in ("display_data", "update_display_data")
    ]
    assert len({d for _, d, _ in _displays(msgs)}) == 1, shown  # one line, updated in place
    print("\n".join(f"{t - record['blocked']:6.2f} {text}" for t, text in shown))
    assert shown, (msgs, sched.log)
    assert shown[0][1] == RELEASING_TEXT, shown
    named = [i for i, (_, text) in enumerate(shown) if "behind your train.ipynb" in text]
    assert named and all(text == RELEASING_TEXT for _, text in shown[: named[0]]), shown
    last = shown[-1][1]
    assert re.fullmatch(
        r"Got the GPU after \d+\.\d s \(restored 640\.00 MiB in \d+\.\d s\)", last
    ), (shown, sched.log)
    waited = float(last.split("after ")[1].split(" s")[0])
    span = shown[-1][0] - shown[0][0]
    # The claim the H100 test checks: the figure exceeds the span of the line's own updates by
    # the threshold (1 s) plus at most an idle poll (0.25 s), less at most a poll (0.1 s) at the
    # grant; the bounds leave 0.2 s below and about a second above for a loaded machine.
    assert 0.8 <= waited - span <= 2.2, (waited, span, shown)
    # The figure is the wait the cell saw, from its blocked launch to the grant (the restore's
    # 1.5 s included: the call passes once it is over).
    assert abs(shown[-1][0] - record["blocked"] - waited) <= 0.5, (waited, record, shown)
    holder.finish(30)
