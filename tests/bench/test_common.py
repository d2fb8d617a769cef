"""The benchmarks' shared helpers: statistics and the scheduler-log parser."""

from __future__ import annotations

import math

from bench.common import median_ci, memory_moves, percentile


def test_percentile_interpolates_and_handles_empty():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert math.isnan(percentile([], 50))


def test_median_ci_brackets_the_median_and_narrows_with_more_samples():
    small = median_ci(list(range(11)))
    large = median_ci(list(range(101)))
    for med, lo, hi in (small, large):
        assert lo <= med <= hi
    assert (large[2] - large[1]) / 101 < (small[2] - small[1]) / 11
    assert median_ci([3.0, 1.0]) == (2.0, 1.0, 3.0)  # too few for an interval: the range


def test_memory_moves_reads_each_move_once():
    log = "\n".join(
        [
            "[I 1 GPUShareScheduler] release client=A evicted=1 bytes=2147483648 (2.0 GiB) "
            "ms=200.0 held_ms=12",
            "[I 1 GPUShareScheduler] evicted client=A bytes=2147483648 (2.0 GiB) ms=200.0 "
            "(on release)",
            "[I 1 GPUShareScheduler] release client=B evicted=0 bytes=0 (0 B) ms=0.0 held_ms=3",
            "[I 1 GPUShareScheduler] restored client=B bytes=1073741824 (1.0 GiB) ms=25.0",
            "[I 1 GPUShareScheduler] evicted client=C bytes=1073741824 (1.0 GiB) ms=100.0",
        ]
    )
    assert memory_moves(log) == [
        {"kind": "evict", "client": "A", "bytes": 2 << 30, "seconds": 0.2},
        {"kind": "restore", "client": "B", "bytes": 1 << 30, "seconds": 0.025},
        {"kind": "evict", "client": "C", "bytes": 1 << 30, "seconds": 0.1},
    ]


def test_launch_summary_pairs_rounds():
    from bench.launch_overhead import summarise

    real = [100.0 + i % 3 for i in range(40)]
    shim = [x + 12.0 for x in real]
    r = summarise(real, shim)
    assert r["paired_diff_ns"] == [12.0] * 40
    assert r["added_ns_median"] == 12.0 and r["added_ns_ci95"] == [12.0, 12.0]
    assert r["met"] and r["plain_median_ns"] == 101.0
    assert not summarise(real, [x + 80.0 for x in real])["met"]
