"""A grant that comes before the memory engine's first block (PyTorch with expandable segments
allocates through cuMemCreate, so the first cudaMalloc may be cuDNN's, after the grant) must not
leave later cudaMalloc'd memory without physical memory. Seen on an H100: cuDNN's handle creation
failed with CUDNN_STATUS_INTERNAL_ERROR because its cudaMemsetAsync hit an unbacked block."""

from __future__ import annotations

MiB = 1 << 20


def test_memory_allocated_after_a_grant_with_no_prior_block_is_backed(harness):
    harness.scheduler(pool="1GiB")
    proc = harness.spawn("late_alloc", 64 * MiB, context_bytes=64 * MiB, log="info", client_id="L")
    result = proc.finish(30).ok()
    granted = result.event("granted")
    assert granted["launches"] > 0
    alloc = result.event("alloc")
    assert alloc["rc"] == 0, alloc
    # Held: nothing of it counts as off the device, and the stand-in's physical memory grew.
    assert alloc["status"]["evicted_bytes"] == 0, alloc["status"]
    assert alloc["status"]["state"] == "holding", alloc["status"]
    assert result.event("data")["ok"], "the new memory could not be written and read back"
