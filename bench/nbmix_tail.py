"""Where the nbmix p95 tail comes from, and what the choice of eviction victims can do about it.

    python -m bench.nbmix_tail [--users 8] [--seeds 20] [--horizon 3600]

For each seed (the traces of :mod:`bench.nbmix`, the daemon's rules at the measured costs) the
cells at or above that seed's p95 slowdown are the *tail*; for them it reports the share of their
added latency (latency less solo time) that is the restore of their own memory that left while
they were idle, and the share spent waiting for the grant. It counts, for every eviction decided
to make room for a waiter, how many idle kernels could have given (the choice the victim ranking
has). And it runs the same seeds with the idle candidates ranked by a *clairvoyant* rule that
reads the trace (:class:`Clairvoyant`: whose memory leaves is chosen knowing each kernel's next
cell), paired with the daemon's: a bound on what any online ranking of victims can gain.

No GPU; about a minute for the defaults. Analysis only: the daemon never reads the trace.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from typing import Any

from jupyter_gpushare.scheduler.core import events as ev
from jupyter_gpushare.scheduler.core.policy import Policy
from jupyter_gpushare.scheduler.core.policy_state import ClientState, DeviceState

from .common import GiB
from .nbmix import WARMUP, trace
from .simulator import SimConfig, Simulation, policy_config, summarize
from .trace import generate


class Clairvoyant(Policy):
    """The daemon's policy, but idle eviction candidates are ranked by the slowdown their memory's
    restore would add to their *next* cell (bytes on the GPU over that cell's solo seconds, read
    from the trace): the least harmed give first. Paused waiters keep the daemon's order after."""

    def __init__(self, *args: Any, sim: Simulation, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sim = sim

    def _next_cell_s(self, c: ClientState) -> float:
        u = self.sim.users[c.id]
        i, cells = u.cell, u.user.cells  # its current cell, or (idle) the next one, already drawn
        return float(cells[i]["gpu"]) if i < len(cells) else math.inf

    def _eviction_candidates(
        self, dev: DeviceState, behind: Iterable[ClientState]
    ) -> list[ClientState]:
        cands = super()._eviction_candidates(dev, behind)
        idle = [c for c in cands if c.waiting_since is None]
        rest = [c for c in cands if c.waiting_since is not None]
        idle.sort(key=lambda c: ((c.away + c.evictable) / self._next_cell_s(c), c.seq))
        return idle + rest


class Probe(Simulation):
    """The simulation, recording per cell its own restore and its wait before the first grant,
    and per eviction for room how many idle kernels could have given."""

    def __init__(self, *args: Any, clairvoyant: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.restore_s: dict[tuple[str, int], float] = {}
        self.waited_s: dict[tuple[str, int], float] = {}
        self.choices: Counter[int] = Counter()
        self._idle_now: int | None = None
        if clairvoyant:
            assert self.policy is not None
            self.policy = Clairvoyant(self.policy.config, sim=self)
            self.policy.add_device(
                "GPU-sim", total_bytes=self.cfg.total_bytes, pool_bytes=self.cfg.pool_bytes
            )

    def _send(self, event: ev.Event) -> None:
        assert self.policy is not None
        dev = next(iter(self.policy._devices.values()))
        self._idle_now = sum(
            1
            for c in dev.clients.values()
            if c.holding is None and c.waiting_since is None and c.evictable > 0
        )
        super()._send(event)

    def _decide(self, d: ev.Decision) -> None:
        u = self.users[d.client]
        if (
            isinstance(d, ev.Evict)
            and d.reason.startswith("room for")
            and self._idle_now is not None
        ):
            self.choices[self._idle_now] += 1  # once per event: one waiter's room
            self._idle_now = None
        if isinstance(d, ev.Grant) and u.in_cell and not u.warming:
            key = (u.user.name, u.cell)
            back = self._movable(u) - u.on_gpu if u.allocated_at is not None else 0
            if d.restore:
                self.restore_s[key] = self.restore_s.get(key, 0.0) + back / self.cfg.restore_bw
            self.waited_s.setdefault(key, self.now - u.arrival)
        super()._decide(d)


def run_seed(users: int, seed: int, horizon: float, clairvoyant: bool = False) -> dict[str, Any]:
    """One seed: its p95, its tail's cells (solo, latency, own restore, wait), the choices."""
    cfg = SimConfig()
    tc = trace("nbmix", users, 1 + 1000 * seed, horizon)
    sim = Probe(
        generate(tc),
        "gpushare",
        horizon,
        cfg,
        policy_config("gpushare", cfg),
        clairvoyant=clairvoyant,
    )
    cells = sim.run()
    p95 = summarize(cells, horizon, warmup=WARMUP)["slowdown_p95"]
    tail = []
    for c in cells:
        if c["arrival"] < WARMUP or c["end"] is None:
            continue
        lat = c["end"] - c["arrival"]
        if lat / c["solo"] >= p95 * (1 - 1e-9):
            key = (c["user"], c["cell"])
            tail.append(
                {
                    "solo": c["solo"],
                    "latency": lat,
                    "restore": sim.restore_s.get(key, 0.0),
                    "waited": sim.waited_s.get(key, 0.0),
                }
            )
    return {"p95": p95, "tail": tail, "choices": sim.choices}


def analyse(users: int, seeds: int, horizon: float) -> dict[str, Any]:
    runs = [run_seed(users, s, horizon) for s in range(seeds)]
    bound = [run_seed(users, s, horizon, clairvoyant=True)["p95"] for s in range(seeds)]
    tail = [t for r in runs for t in r["tail"] if t["solo"] < 1.0]
    added = sum(t["latency"] - t["solo"] for t in tail) or math.nan
    choices: Counter[int] = Counter()
    for r in runs:
        choices.update(r["choices"])
    diffs = [b - r["p95"] for b, r in zip(bound, runs, strict=True)]
    restore_gib = [t["restore"] * SimConfig().restore_bw / GiB for t in tail if t["restore"] > 0]
    return {
        "users": users,
        "seeds": seeds,
        "p95_mean": statistics.mean(r["p95"] for r in runs),
        "tail_short_cells": len(tail),
        "restore_share": sum(t["restore"] for t in tail) / added,
        "wait_share": sum(t["waited"] for t in tail) / added,
        "restore_gib_quartiles": statistics.quantiles(restore_gib, n=4) if restore_gib else [],
        "evictions_by_idle_candidates": dict(sorted(choices.items())),
        "clairvoyant_p95_mean": statistics.mean(bound),
        "clairvoyant_diff": statistics.mean(diffs),
        "clairvoyant_diff_ci": (
            1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", default="8")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--horizon", type=float, default=3600.0)
    args = ap.parse_args(argv)
    for n in args.users.split(","):
        a = analyse(int(n), args.seeds, args.horizon)
        q = ", ".join(f"{x:.1f}" for x in a["restore_gib_quartiles"])
        print(
            f"{a['users']} users, {a['seeds']} seeds: p95 {a['p95_mean']:.2f}x; tail: "
            f"{a['tail_short_cells']} short cells, added latency {a['restore_share']:.0%} own "
            f"restore, {a['wait_share']:.0%} wait; restore GiB quartiles {q}\n"
            f"  evictions for room by idle kernels that could give: "
            f"{a['evictions_by_idle_candidates']}\n"
            f"  clairvoyant victims: p95 {a['clairvoyant_p95_mean']:.2f}x "
            f"({a['clairvoyant_diff']:+.3f} ± {a['clairvoyant_diff_ci']:.3f} paired)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
