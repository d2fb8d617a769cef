"""What moving a kernel's memory costs, as measured on the GPU: one module for the policy and
the simulator.

Every constant is a committed measurement; its source is named beside it (a result file of a
GPU campaign under docs/perf-runs/, with the commit that produced it, or a row of the GPU
facts table that the campaigns' logs under docs/gpu-runs/ back). The policy's initial bandwidth
estimates (:class:`~.policy_config.PolicyConfig`) and the simulator's engine model
(:class:`bench.simulator.SimConfig`) both start from these; the policy then follows what the
shims report: an EWMA of each client's own moves, each report cut to
[:data:`SLOWEST_MOVE_BPS`, :data:`BUS_BPS`], used for that client only.

The model (:func:`evict_seconds`, :func:`restore_seconds`):

- **staged eviction**: the kernel's host staging is ready (registered host memory): device to
  host at :data:`EVICT_STAGED_BPS`;
- **pre-copied eviction**: the bytes that have a current host copy (a PRECOPY's result) only
  need an unmap: :data:`UNMAP_S_PER_GIB`;
- **cold eviction**: staging is not ready yet (an eviction within :func:`staging_ready_after`
  of the kernel's allocation, later when other allocations stage before it):
  :data:`EVICT_COLD_BPS`;
- **restore**: host to device at :data:`RESTORE_BPS`, only the bytes that were evicted; a
  kernel's first restore at :data:`FIRST_RESTORE_BPS`;
- **pre-copy**: in the background at :data:`PRECOPY_BPS` while the kernel stays resident;
- **drain**: after a revoke the holder's launched work runs on for :data:`DRAIN_S`;
- **grant**: a handoff without memory to move takes :data:`HANDOFF_S`.
"""

from __future__ import annotations

__all__ = [
    "BLOCK_BYTES",
    "BUS_BPS",
    "DRAIN_S",
    "EVICT_COLD_BPS",
    "EVICT_STAGED_BPS",
    "FIRST_RESTORE_BPS",
    "HANDOFF_S",
    "PRECOPY_BPS",
    "RESTORE_BPS",
    "SLOWEST_MOVE_BPS",
    "SOURCES",
    "STAGING_PAUSE_S",
    "STAGING_SHARED_S_PER_GIB",
    "STAGING_S_PER_GIB",
    "UNMAP_S_PER_GIB",
    "evict_seconds",
    "restore_seconds",
    "staging_ready_after",
]

GiB = 1 << 30

_MEMORY = "docs/perf-runs/2026-11-27-gpu/memory-h100-8c053a7.json (commit 8c053a7, H100)"
_HANDOFF = "docs/perf-runs/2026-11-27-gpu/handoff-h100-8c053a7.json (commit 8c053a7, H100)"
_COLD = "docs/perf-runs/2026-11-27-gpu/cold_eviction-h100-8c053a7.json (commit 8c053a7, H100)"
_COLD_H200 = "docs/perf-runs/2026-11-27-gpu/cold_eviction-h200-34b45a0.json (commit 34b45a0, H200)"
_ENGINE = (
    "docs/gpu-runs/2026-11-28-c/4-rerun-h100-95c641b.tar.gz logs/test_gpu_memory_engine.log"
    " (commit 95c641b, H100)"
)
_STAGING = (
    "docs/gpu-verification.md 2026-11-28 (b) step 1 (docs/gpu-runs/2026-11-28-b/1-verify-*,"
    " commit 8a4072a, H100)"
)

#: Device to host into ready (registered) staging: the engine test's median, 51.9 GB/s (n=4).
EVICT_STAGED_BPS = 51.9e9
#: Host to device, every restore but a size's first: the engine test's median, 48.5 GB/s (n=4).
RESTORE_BPS = 48.5e9
#: A kernel's first restore: 3 of the 24 restores of memory-h100-8c053a7.json ran at 5.5, 6.0 and
#: 6.7 GB/s, each the first of its size (a fresh process's first host-to-device copy): their mean.
FIRST_RESTORE_BPS = (5_522_298_034.072645 + 5_957_785_124.150368 + 6_696_029_584.359702) / 3
#: Unmapping pre-copied memory: the engine test's idle kernel of 14 GiB left in 10.6 ms.
UNMAP_S_PER_GIB = 0.0106 / 14
#: A pre-copy in the background: precopied_arrival and precopied_arrival_kept, 3 idle kernels of
#: 12 GiB each copied in 2.470 s and 2.508 s (15.65 and 15.41 GB/s): the mean of the two rates.
PRECOPY_BPS = (3 * 12 * GiB / 2.470449375000044 + 3 * 12 * GiB / 2.508432393000021) / 2
#: Eviction before staging is ready (through the bounce ring): both runs started 0.5 s after a
#: 20 GiB allocation, 2.58 and 2.54 GB/s, their mean (every run, none left out: the H200's
#: 1.3 and 8.8 GB/s at 34b45a0 bracket it).
EVICT_COLD_BPS = (2.58179283945274e9 + 2.5428753336254157e9) / 2
#: A lone allocation's staging is ready within 2 s of a 20 GiB allocation (every eviction started
#: 2 s after it ran at 48.6-50.6 GB/s): an upper bound of (2 s - the pause) / 20 GiB ...
STAGING_S_PER_GIB = (2.0 - 0.1) / 20
#: ... after the engine's pause for a quiet moment (GPUSHARE_STAGING_QUIET's default).
STAGING_PAUSE_S = 0.1
#: Staging under concurrency: 32 kernels each allocating 1 GiB at once were ready 0.81 s (the
#: middle) to 4.9 s (the slowest) after the allocation. The node's staging is one queue: an
#: allocation waits for what others staged before it, at (4.9 s - the pause) / 32 GiB, the rate
#: that makes the last of the 32 ready at 4.9 s.
STAGING_SHARED_S_PER_GIB = (4.9 - 0.1) / 32
#: After a revoke the launched work drains: 12.5 ms on average (half a step of bench/worker.py,
#: which synchronises every 16 matmuls of ~1.6 ms; docs/performance.md, "drain"). A design value,
#: not a measurement: the replay's per-cell costs that the simulator does not model stand in it.
DRAIN_S = 0.0125
#: A grant without memory to move: handoff.json no_memory.p50_ms.
HANDOFF_S = 0.0015924909999966985
#: The unit of the policy's asks: a partial eviction asks for what is missing rounded up to it.
#: The engine frees whole allocations, least recently used first, so it may free more.
BLOCK_BYTES = 32 << 20

#: The bus: pinned copies, the faster direction (device to host, 54.0 GB/s; host to device 51.0),
#: on the H100. No move of a kernel's memory is faster: a faster report is cut. Moves in one
#: direction share it (the simulator queues them: bench/simulator.py, ``shared_bus``).
BUS_BPS = 53_998_580_662.582794
#: The slowest move measured: an eviction before staging was ready, 1.3 GB/s (the lowest of the
#: cold-eviction runs). A slower report is cut to it (A28: forged timings must not stretch turns).
SLOWEST_MOVE_BPS = 1.3e9

#: Each constant's source, for the report and the tests.
SOURCES: dict[str, str] = {
    "EVICT_STAGED_BPS": _ENGINE + ": eviction 51.9 GB/s (n=4, median)",
    "RESTORE_BPS": _ENGINE + ": restore 48.5 GB/s (n=4, median)",
    "FIRST_RESTORE_BPS": _MEMORY + " shim.restore.samples below 10 GB/s (each size's first)",
    "UNMAP_S_PER_GIB": _ENGINE + ": A (14 GiB) evicted in 10.6 ms after its pre-copy",
    "PRECOPY_BPS": _MEMORY + " precopied_arrival{,_kept}: 3 x 12 GiB / precopy_seconds, mean",
    "EVICT_COLD_BPS": _COLD + ": mean evict_gbps of the runs at delay_s 0.5",
    "STAGING_S_PER_GIB": _COLD + ": evictions at delay_s 2 ran at the staged bandwidth",
    "STAGING_SHARED_S_PER_GIB": _STAGING + ": 32 x 1 GiB ready 0.81-4.9 s after allocation",
    "STAGING_PAUSE_S": "native/src/base/config.c: GPUSHARE_STAGING_QUIET's default",
    "DRAIN_S": "docs/performance.md (the replay workers' half step; a design value)",
    "HANDOFF_S": _HANDOFF + " no_memory.p50_ms",
    "BLOCK_BYTES": "the policy's unit of an ask; the engine frees whole allocations",
    "BUS_BPS": _MEMORY + " max(pinned_memcpy.d2h, pinned_memcpy.h2d)",
    "SLOWEST_MOVE_BPS": _COLD_H200 + ": the lowest evict_gbps of the runs at delay_s 0.5",
}


def staging_ready_after(nbytes: int, queued: int = 0) -> float:
    """Seconds after an allocation of ``nbytes`` until its host staging is ready, ``queued``
    bytes of other allocations staging before it (the node's one queue)."""
    return (
        STAGING_PAUSE_S
        + nbytes / GiB * STAGING_S_PER_GIB
        + max(0, queued) / GiB * STAGING_SHARED_S_PER_GIB
    )


def evict_seconds(
    nbytes: int,
    precopied: int = 0,
    staged: bool = True,
    *,
    staged_bps: float = EVICT_STAGED_BPS,
    cold_bps: float = EVICT_COLD_BPS,
    unmap_s_per_gib: float = UNMAP_S_PER_GIB,
) -> float:
    """Seconds to free ``nbytes`` of which ``precopied`` have a current host copy (unmapped
    first); the rest is copied at the staged or the cold bandwidth."""
    nbytes = max(0, nbytes)
    unmap = min(nbytes, max(0, precopied))
    rest = nbytes - unmap
    return unmap / GiB * unmap_s_per_gib + rest / (staged_bps if staged else cold_bps)


def restore_seconds(nbytes: int, bps: float = RESTORE_BPS) -> float:
    """Seconds to bring ``nbytes`` back onto the GPU."""
    return max(0, nbytes) / bps
