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
  of the kernel's allocation): :data:`EVICT_COLD_BPS`;
- **restore**: host to device at :data:`RESTORE_BPS`, only the bytes that were evicted;
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
    "HANDOFF_S",
    "PRECOPY_BPS",
    "RESTORE_BPS",
    "SLOWEST_MOVE_BPS",
    "SOURCES",
    "STAGING_PAUSE_S",
    "STAGING_S_PER_GIB",
    "UNMAP_S_PER_GIB",
    "evict_seconds",
    "restore_seconds",
    "staging_ready_after",
]

GiB = 1 << 30

_MEMORY = "docs/perf-runs/2026-11-24-h100-b/memory.json (commit 0c1c510, H100)"
_HANDOFF = "docs/perf-runs/2026-11-24-h100-b/handoff.json (commit 0c1c510, H100)"
_COLD = (
    "docs/perf-runs/2026-11-27-gpu/cold_eviction-*.json (bench/cold_eviction.py, H100 at 05f7b2e,"
    " H200 at 34b45a0)"
)

#: Device to host into ready (registered) staging: memory.json shim.evict_warm.median.
EVICT_STAGED_BPS = 50_268_811_985.0
#: Host to device: memory.json shim.restore.median.
RESTORE_BPS = 47_484_799_419.5
#: Unmapping pre-copied memory: memory.json precopied_arrival: 12 GiB evicted in 8.2 ms.
UNMAP_S_PER_GIB = 0.0082 / 12
#: A pre-copy in the background: memory.json precopied_arrival: 3 idle kernels of 12 GiB each
#: copied in 5.67 s (precopy_seconds).
PRECOPY_BPS = 3 * 12 * GiB / 5.672817891999983
#: Eviction before staging is ready (through the bounce ring): the median of the six runs
#: started 0.5 s after a 20 GiB allocation (1.3-9.7 GB/s; the first eviction on a fresh machine
#: is the slow one).
EVICT_COLD_BPS = 8.9e9
#: Staging is ready within 2 s of a 20 GiB allocation (every eviction started 2 s after it ran
#: at 49-51 GB/s): an upper bound of (2 s - the pause) / 20 GiB ...
STAGING_S_PER_GIB = (2.0 - 0.1) / 20
#: ... after the engine's pause for a quiet moment (GPUSHARE_STAGING_QUIET's default).
STAGING_PAUSE_S = 0.1
#: After a revoke the launched work drains: 12.5 ms on average (half a step of bench/worker.py,
#: which synchronises every 16 matmuls of ~1.6 ms; docs/performance.md, "drain").
DRAIN_S = 0.0125
#: A grant without memory to move: handoff.json no_memory.p50_ms.
HANDOFF_S = 0.0016544630000012717
#: The unit of the policy's asks: a partial eviction asks for what is missing rounded up to it.
#: The engine frees whole allocations, least recently used first, so it may free more.
BLOCK_BYTES = 32 << 20

#: The bus: pinned copies, the faster direction (device to host, 54.8 GB/s; host to device 54.2),
#: on the H100. No move of a kernel's memory is faster: a faster report is cut.
BUS_BPS = 54823519016.879944
#: The slowest move measured: an eviction before staging was ready, 1.3 GB/s (the lowest of the
#: cold-eviction runs). A slower report is cut to it (A28: forged timings must not stretch turns).
SLOWEST_MOVE_BPS = 1.3e9

#: Each constant's source, for the report and the tests.
SOURCES: dict[str, str] = {
    "EVICT_STAGED_BPS": _MEMORY + " shim.evict_warm.median",
    "RESTORE_BPS": _MEMORY + " shim.restore.median",
    "UNMAP_S_PER_GIB": _MEMORY + " precopied_arrival.evictions[0].seconds / 12 GiB",
    "PRECOPY_BPS": _MEMORY + " precopied_arrival: 3 x 12 GiB / precopy_seconds",
    "EVICT_COLD_BPS": _COLD + ": median evict_gbps of the runs at delay_s 0.5",
    "STAGING_S_PER_GIB": _COLD + ": evictions at delay_s 2 ran at the staged bandwidth",
    "STAGING_PAUSE_S": "native/src/base/config.c: GPUSHARE_STAGING_QUIET's default",
    "DRAIN_S": "docs/performance.md (the replay workers' half step)",
    "HANDOFF_S": _HANDOFF + " no_memory.p50_ms",
    "BLOCK_BYTES": "the policy's unit of an ask; the engine frees whole allocations",
    "BUS_BPS": _MEMORY + " max(pinned_memcpy.d2h, pinned_memcpy.h2d)",
    "SLOWEST_MOVE_BPS": _COLD + ": the lowest evict_gbps of the runs at delay_s 0.5 (1.3 GB/s)",
}


def staging_ready_after(nbytes: int) -> float:
    """Seconds after an allocation of ``nbytes`` until its host staging is ready."""
    return STAGING_PAUSE_S + nbytes / GiB * STAGING_S_PER_GIB


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
