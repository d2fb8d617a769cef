"""bench/nbmix_tail.py: the tail's attribution and the clairvoyant bound on victim choice."""

from __future__ import annotations

from bench.nbmix_tail import Probe, run_seed
from bench.simulator import SimConfig, policy_config
from bench.trace import GiB, User
from jupyter_gpushare.scheduler.core import events as ev

CFG = SimConfig()


def _users() -> list[User]:
    """u0 and u1 (16 GiB each) run a cell and go idle; u3 (8 GiB) then fills the pool, and u2
    (16 GiB) needs one of u0 and u1 to leave. u0's next cell is short, u1's is long."""
    return [
        User("u0", 16 * GiB, [{"think": 2.0, "gpu": 0.5}, {"think": 1000.0, "gpu": 0.05}]),
        User("u1", 16 * GiB, [{"think": 1.0, "gpu": 0.5}, {"think": 1000.0, "gpu": 100.0}]),
        User("u3", 8 * GiB, [{"think": 30.0, "gpu": 0.5}]),
        User("u2", 16 * GiB, [{"think": 60.0, "gpu": 0.5}]),
    ]


def _first_victim(clairvoyant: bool) -> str:
    sim = Probe(
        _users(), "gpushare", 200.0, CFG, policy_config("gpushare", CFG), clairvoyant=clairvoyant
    )
    sim.log = []
    sim.run()
    evicts = [d for _, ds in sim.log for d in ds if isinstance(d, ev.Evict)]
    assert evicts and evicts[0].reason == "room for u2"
    return evicts[0].client


def test_the_clairvoyant_ranking_takes_memory_from_the_kernel_whose_next_cell_is_long():
    assert _first_victim(clairvoyant=False) == "u0"  # the daemon cannot know
    assert _first_victim(clairvoyant=True) == "u1"  # u1's 100 s cell absorbs its restore


def test_a_short_cell_that_restores_its_memory_is_attributed_to_its_restore():
    sim = Probe(_users(), "gpushare", 2000.0, CFG, policy_config("gpushare", CFG))
    sim.run()
    # u0 left for u2 (whole: 16 GiB); its next 0.05 s cell restores it all
    assert abs(sim.restore_s[("u0", 1)] - 16 * GiB / CFG.restore_bw) < 1e-9
    assert sim.waited_s[("u0", 1)] < 0.05  # granted at once: the pool has room by then
    assert sim.choices == {2: 2}  # room for u2 (u0 or u1 could give), then for u0 (u2 or u3)


def test_run_seed_reports_the_tail_of_an_nbmix_seed():
    r = run_seed(8, 0, 1200.0)
    assert r["tail"] and all(t["latency"] / t["solo"] >= r["p95"] * (1 - 1e-9) for t in r["tail"])
    assert any(t["restore"] > 0 for t in r["tail"])
