"""Soak: many kernels taking turns for a minute, with random kills, reconnects and scheduler
restarts, and invariants checked all along.

64 simulated shims (Python, speaking the protocol over the real socket, reconnecting and resuming
as the C shim does) and a few real shimmed processes on the stand-in driver share a 1 GiB pool
with a short quantum. A seeded random schedule kills simulated kernels (their socket dropped, as
by SIGKILL), SIGKILLs real ones, and crashes the scheduler (connections dropped, socket left
behind) to start a new one on the same socket. Checked every 50 ms:

* the kernels that believe they hold the device fit the pool together (or one runs alone);
* the scheduler's holders fit the pool (or one runs alone) and are all alive;
* no client stays attributed after its death (1 s of grace for the socket to close);
* each simulated kernel's memory is exactly what it reported;
* every request is granted within ``WAIT_BOUND`` seconds.

At the end everyone releases: nobody holds, nobody waits, the clients are exactly the survivors,
and the pool's memory is their memory. Real processes that were not killed ended with their
data intact.

GPUSHARE_SOAK_SECONDS (default 60) and GPUSHARE_SOAK_SEED (default 1) make longer or other runs;
the random schedule is reproducible, the interleavings of a live system are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from sched_helpers import DEVICE, FakeCredScheduler, FakeShim

from jupyter_gpushare.protocol import MsgType

MiB = 1 << 20
POOL = 1024 * MiB
SIMS = 64
REAL = 3
SECONDS = float(os.environ.get("GPUSHARE_SOAK_SECONDS", "60"))
SEED = int(os.environ.get("GPUSHARE_SOAK_SEED", "1"))
WAIT_BOUND = 45.0  # seconds: 64 kernels, short turns, restarts included
GRACE = 1.0  # seconds for a dead client's socket to close and its Leave to be handled
RECOVERY = 2.6  # the real shims retry within 2.5 s


@dataclass
class Sim:
    """One simulated kernel: the C shim's client state machine, in Python."""

    cid: str
    used: int
    rng: random.Random
    long_holder: bool  # keeps the device until revoked (a cell running past its quantum)
    holding: bool = False
    waiting_since: float | None = None
    hold_since: float = 0.0
    gpu: float = 0.0
    evicted: bool = False
    alive: bool = True
    connected: bool = False
    shim: FakeShim | None = None
    waits: list[float] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class Soak:
    def __init__(self, path: str, rng: random.Random) -> None:
        self.path = path
        self.rng = rng
        self.sims: dict[str, Sim] = {}
        self.dead: dict[str, float] = {}  # client id -> when it died
        self.serial = 0
        self.scheduler: FakeCredScheduler | None = None
        self.stop = False
        self.quiet = False  # the end: nobody requests any more
        self.failures: list[str] = []
        self.counts = {"grants": 0, "kills": 0, "restarts": 0, "reconnects": 0, "real_kills": 0}

    # -- the scheduler -------------------------------------------------------------------------

    async def start_scheduler(self) -> None:
        sched = FakeCredScheduler(
            socket_path=self.path,
            use_nvml=False,
            pool_size=str(POOL),
            base_quantum=0.2,
            max_quantum=2.0,
            recovery_seconds=RECOVERY,
            utilization_interval=0,
        )
        await sched.start()
        self.scheduler = sched

    async def crash_scheduler(self) -> None:
        """As SIGKILL would: every connection drops, nothing is said, the socket stays."""
        sched = self.scheduler
        assert sched is not None and sched._server is not None
        self.scheduler = None
        sched._stopping = True
        sched._cancel_timer()
        server, sched._server = sched._server, None
        server.close()
        for conn in list(sched._connections.values()):
            if conn.writer is not None:
                conn.writer.transport.abort()
        if not os.path.exists(self.path):
            # The listening socket's file as a killed process leaves it: bound, nobody there.
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stale.bind(self.path)
            stale.close()
        self.counts["restarts"] += 1

    # -- simulated kernels ---------------------------------------------------------------------

    def new_sim(self) -> Sim:
        self.serial += 1
        sim = Sim(
            cid=f"sim{self.serial}",
            used=self.rng.choice([96, 192, 320, 448, 640]) * MiB,
            rng=random.Random(self.rng.random()),
            long_holder=self.rng.random() < 0.15,
        )
        self.sims[sim.cid] = sim
        sim.task = asyncio.ensure_future(self.run_sim(sim))
        return sim

    def kill_sim(self, sim: Sim) -> None:
        sim.alive = False
        sim.holding = False
        self.dead[sim.cid] = time.monotonic()
        del self.sims[sim.cid]
        if sim.shim is not None:
            sim.shim.writer.transport.abort()
        if sim.task is not None:
            sim.task.cancel()
        self.counts["kills"] += 1

    async def run_sim(self, sim: Sim) -> None:
        backoff = 0.05
        first = True
        while sim.alive and not self.stop:
            try:
                sim.shim = await FakeShim.connect(self.path)
            except OSError:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            backoff = 0.05
            try:
                await self.session(sim, first)
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                pass
            finally:
                sim.connected = False
                with contextlib.suppress(Exception):
                    sim.shim.writer.transport.abort()
            if sim.holding:  # lost the scheduler while holding: keep running, resume later
                sim.gpu += time.monotonic() - sim.hold_since
            first = False
            self.counts["reconnects"] += 1

    async def session(self, sim: Sim, first: bool) -> None:
        shim = sim.shim
        assert shim is not None
        now = time.monotonic()
        fields: dict[str, Any] = {
            "used_bytes": sim.used,
            "managed_bytes": sim.used,
            "pinned_bytes": 0,
            "evicted_bytes": sim.used if sim.evicted else 0,
        }
        if not first:
            resume = 1 if sim.holding else 2 if sim.waiting_since is not None else 0
            since = sim.hold_since if sim.holding else sim.waiting_since or now
            fields |= {
                "resume": resume,
                "since_ms": int((now - since) * 1000) if resume else 0,
                "gpu_ms": int(sim.gpu * 1000),
            }
        welcome = await shim.hello(sim.cid, device=DEVICE, total=80 << 30, **fields)
        if sim.holding and welcome.get("resume") != 1:
            # The grant was not given back: the running cell's next call asks again.
            self.release(sim)
            sim.waiting_since = time.monotonic()
        if sim.holding:
            sim.hold_since = time.monotonic()
        # A call blocked across the reconnect asks again, as the shim does.
        ask_again = sim.waiting_since is not None
        sim.connected = True
        reader = asyncio.ensure_future(self.read(sim, shim))
        try:
            while sim.alive and not self.stop and not reader.done():
                if sim.holding:
                    if sim.long_holder and not self.quiet:
                        await asyncio.sleep(0.05)  # runs until revoked
                        continue
                    await asyncio.sleep(sim.rng.uniform(0.005, 0.08))
                    if sim.holding:  # the cell ended: hand the device back
                        self.release(sim)
                        await shim.send(MsgType.RELEASED, flag=0, evicted_bytes=0)
                elif sim.waiting_since is None and not self.quiet:
                    await asyncio.sleep(sim.rng.uniform(0.05, 1.5))
                    if not sim.holding and sim.waiting_since is None and not self.quiet:
                        sim.waiting_since = time.monotonic()
                        await shim.request(sim.used, evicted=sim.used if sim.evicted else 0)
                elif ask_again:
                    ask_again = False
                    await shim.request(sim.used, evicted=sim.used if sim.evicted else 0)
                else:
                    await asyncio.sleep(0.05)
            await reader
        finally:
            reader.cancel()

    def release(self, sim: Sim) -> None:
        sim.holding = False
        sim.gpu += time.monotonic() - sim.hold_since

    async def read(self, sim: Sim, shim: FakeShim) -> None:
        while True:
            msg = await shim.recv(timeout=3600)
            if msg is None:
                return
            if msg.type == MsgType.GRANT:
                now = time.monotonic()
                if sim.waiting_since is not None:
                    sim.waits.append(now - sim.waiting_since)
                sim.waiting_since = None
                sim.holding = True
                sim.hold_since = now
                sim.evicted = False
                self.counts["grants"] += 1
                if msg.get("flag"):
                    await shim.send(MsgType.RESTORED, bytes_moved=sim.used, micros=100)
            elif msg.type == MsgType.REVOKE:
                if not sim.holding:
                    continue  # crossed our own release: the scheduler has it already
                self.release(sim)
                evict = bool(msg.get("flag"))
                sim.evicted = sim.evicted or evict
                await shim.send(
                    MsgType.RELEASED,
                    flag=int(evict),
                    evicted_bytes=sim.used if sim.evicted else 0,
                    bytes_moved=sim.used if evict else 0,
                    micros=100,
                )
            elif msg.type == MsgType.EVICT:
                moved = 0 if sim.holding else sim.used
                if not sim.holding:
                    sim.evicted = True
                await shim.send(
                    MsgType.EVICTED,
                    bytes_moved=moved,
                    micros=100,
                    evicted_bytes=sim.used if sim.evicted else 0,
                )

    # -- invariants ----------------------------------------------------------------------------

    def fail(self, text: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(f"{time.monotonic():.3f}: {text}")

    def check(self, real_alive: set[str]) -> None:
        now = time.monotonic()
        believers = [s for s in self.sims.values() if s.holding]
        if len(believers) > 1 and sum(s.used for s in believers) > POOL:
            self.fail(f"kernels that hold do not fit: {[(s.cid, s.used) for s in believers]}")
        for s in self.sims.values():
            if s.waiting_since is not None and now - s.waiting_since > WAIT_BOUND:
                self.fail(f"{s.cid} waits for {now - s.waiting_since:.1f} s")
        sched = self.scheduler
        if sched is None or sched.policy is None:
            return
        for dev in sched.status_document()["devices"]:
            clients = {c["id"]: c for c in dev["clients"]}
            holders = [clients[h] for h in dev["holders"]]
            if len(holders) > 1 and sum(h["used_bytes"] for h in holders) > dev["pool_bytes"]:
                self.fail(f"the scheduler's holders do not fit: {dev['holders']}")
            for cid, c in clients.items():
                base = cid.split("#")[0]
                if base in self.dead and now - self.dead[base] > GRACE:
                    self.fail(f"{cid} is attributed {now - self.dead[base]:.1f} s after its death")
                sim = self.sims.get(cid)
                if sim is not None and c["used_bytes"] != sim.used:
                    self.fail(f"{cid}: scheduler says {c['used_bytes']}, the kernel {sim.used}")
                if sim is None and base not in self.dead and base not in real_alive:
                    self.fail(f"{cid}: a client nobody started")


@pytest.mark.timeout(SECONDS + 180)
async def test_soak_many_kernels_kills_and_restarts(harness: Any) -> None:
    rng = random.Random(SEED)
    soak = Soak(str(harness.socket_path), rng)
    await soak.start_scheduler()
    for _ in range(SIMS):
        soak.new_sim()

    real: dict[str, Any] = {}
    real_done: list[Any] = []
    real_killed: set[str] = set()
    real_serial = 0

    def spawn_real() -> None:
        nonlocal real_serial
        real_serial += 1
        cid = f"real{real_serial}"
        real[cid] = harness.spawn(
            "hold",
            rng.uniform(0.5, 2.0),
            rng.choice([64, 256]) * MiB,
            5000,
            # The same device as the simulated kernels: they share one pool.
            extra={"GPUSHARE_FAKE_UUID": DEVICE, "GPUSHARE_FAKE_DEVICE_TOTAL": "80GiB"},
            client_id=cid,
            context_bytes=32 * MiB,
            idle_seconds=0,
            log="info",
        )

    for _ in range(REAL):
        spawn_real()

    start = time.monotonic()
    next_restart = start + rng.uniform(8, 15)
    next_kill = start + rng.expovariate(3.0)
    try:
        while time.monotonic() - start < SECONDS:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for cid, proc in list(real.items()):
                if proc.popen.poll() is not None:
                    real_done.append((cid, proc))
                    del real[cid]
                    soak.dead[cid] = now
                    spawn_real()
            if now >= next_kill:
                next_kill = now + rng.expovariate(3.0)
                if rng.random() < 0.1 and real:
                    cid = rng.choice(sorted(real))
                    real[cid].signal(signal.SIGKILL)
                    real_killed.add(cid)
                    soak.counts["real_kills"] += 1
                elif soak.sims:
                    soak.kill_sim(soak.sims[rng.choice(sorted(soak.sims))])
                    soak.new_sim()
            if now >= next_restart and soak.scheduler is not None:
                next_restart = now + rng.uniform(10, 20)
                await soak.crash_scheduler()
                await asyncio.sleep(rng.uniform(0.1, 1.0))
                await soak.start_scheduler()
            soak.check(set(real))
            assert not soak.failures, "\n".join(soak.failures)

        # The end: nobody asks any more; holders finish their cells; the real ones finish.
        soak.quiet = True
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            soak.check(set(real))
            busy = [s for s in soak.sims.values() if s.holding or s.waiting_since is not None]
            if not busy and all(p.popen.poll() is not None for p in real.values()):
                break
        for cid, proc in real.items():
            real_done.append((cid, proc))
            soak.dead[cid] = time.monotonic()
        await asyncio.sleep(GRACE + 0.5)
        assert not soak.failures, "\n".join(soak.failures)

        busy = [s.cid for s in soak.sims.values() if s.holding or s.waiting_since is not None]
        assert not busy, f"still holding or waiting at the end: {busy}"
        assert soak.scheduler is not None
        (dev,) = soak.scheduler.status_document()["devices"]
        assert dev["holders"] == [] and dev["queue"] == [], dev
        clients = {c["id"]: c for c in dev["clients"]}
        assert set(clients) == set(soak.sims), set(clients) ^ set(soak.sims)
        for cid, sim in soak.sims.items():
            assert clients[cid]["used_bytes"] == sim.used
            assert clients[cid]["state"] in ("idle", "evicting"), clients[cid]
        resident = dev["resident_bytes"]
        assert 0 <= resident <= sum(s.used for s in soak.sims.values())
        for cid, proc in real_done:
            run = proc.finish(60)
            if cid in real_killed:
                assert run.returncode == -signal.SIGKILL, run.describe()
            else:
                run.ok()
                assert run.event("hold_end")["data_ok"], run.describe()
        waits = sorted(w for s in soak.sims.values() for w in s.waits)
        assert soak.counts["grants"] > SIMS and soak.counts["restarts"] >= 1, soak.counts
        print(
            f"soak {SECONDS:.0f} s, seed {SEED}: {soak.counts}; real processes "
            f"{len(real_done)} ({len(real_killed)} killed); waits: median "
            f"{waits[len(waits) // 2]:.3f} s, max {waits[-1]:.2f} s"
        )
    finally:
        soak.stop = True
        for sim in list(soak.sims.values()):
            if sim.task is not None:
                sim.task.cancel()
        if soak.scheduler is not None:
            await soak.scheduler.stop()
