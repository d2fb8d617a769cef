"""No thrashing (issue 35, item 5): under overload the cap on long cells holding memory (the
policy's core/overload.py) cuts the bytes moved per useful GPU-second against the same seeds
without it, measured in this run, and the tail at 32 users is no worse for it."""

from __future__ import annotations

from bench.nbmix import point

SEEDS, HORIZON = 2, 3600.0


def test_the_cap_cuts_the_bytes_moved_under_overload():
    capped = {n: point("nbmix", n, "after", SEEDS, HORIZON) for n in (16, 32)}
    free = {n: point("nbmix", n, "after-no-cap", SEEDS, HORIZON) for n in (16, 32)}
    moved = {n: r["moved_gb_per_gpu_s"] for n, r in capped.items()}
    # Overloaded (16 and 32 users): the cap moves at most 0.8 of what the same seeds move
    # without it (these 2 seeds: 0.49 and 0.65; 3 seeds: 0.52 and 0.42).
    for n in (16, 32):
        assert moved[n] <= 0.8 * free[n]["moved_gb_per_gpu_s"], (n, moved, free[n])
    # (They still grow faster than the users, 2.6x and 2.9x per doubling over 40 and 20 seeds:
    # not asserted, docs/performance.md §8c.)
    # The tail at 32 users is no worse for it (these seeds: 9.2x against 12.7x).
    assert capped[32]["slowdown_p95_mean"] <= 1.1 * free[32]["slowdown_p95_mean"]
