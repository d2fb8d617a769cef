"""Memory the driver keeps for a process outside its allocations counts against the quota and in
what the scheduler sees, as pinned (issue 12 fault 5, issue 11): what stream-ordered pools keep
reserved after cuMemFreeAsync, and graph memory (cuGraphAddMemAllocNode, cuMemAllocAsync captured
into a graph, backed when the graph is launched). Trims lower the count; nothing is counted twice.

native/tests/reserves_probe.c runs each path against the stand-in driver, which models pools with
a release threshold, mem-alloc nodes and the device's graph pool (native/tests/fake_graph.c); each
step reports the shim's numbers next to the driver's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Harness, NativeBuild, _load_build_module
from tests.native.probe import run_probe, spawn_probe

MiB = 1 << 20
GiB = 1 << 30
CONTEXT = 64 * MiB
QUOTA = "1GiB"
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def reserves_probe(native_build: NativeBuild) -> Path:
    fake = native_build.fake_dir
    return _load_build_module().build_program(
        [ROOT / "native" / "tests" / "reserves_probe.c"],
        native_build.root / "bin" / "reserves_probe",
        [f"-L{fake}", "-l:libcuda.so.1", f"-Wl,-rpath,{fake}"],
    )


def probe(harness: Harness, path: Path, *args: Any, **gpushare: Any):
    settings = {"context_bytes": CONTEXT, "memory_limit": QUOTA, **gpushare}
    return run_probe(harness, path, *args, **settings).ok()


def quota_lines(run) -> list[str]:
    return [line for line in run.shim_lines if "over its quota" in line]


@pytest.mark.parametrize("pool", ["current", "created"])
def test_a_pools_reserve_after_frees_counts_until_trimmed(harness, reserves_probe, pool):
    size = 256 * MiB
    run = probe(harness, reserves_probe, "pool", pool, 1, size, 3)
    allocated = run.event("allocated")
    assert allocated["rc"] == 0 and allocated["ok"] == 3
    assert allocated["status"]["used_bytes"] == CONTEXT + 3 * size, allocated
    # Freed, the pool keeps everything (release threshold at the maximum, as PyTorch sets it):
    # the process still holds it, and the status says so, as pinned memory.
    freed = run.event("freed")
    assert freed["driver"]["pool_reserved"] == 3 * size and freed["driver"]["pool_used"] == 0
    assert freed["status"]["used_bytes"] == CONTEXT + 3 * size, freed
    assert freed["status"]["pinned_bytes"] == CONTEXT + 3 * size, freed
    # So another allocation of the same size no longer fits the quota...
    assert run.event("alloc_after_free")["rc"] == OOM
    assert len(quota_lines(run)) == 1, run.stderr
    # ...but one the pool serves from what it keeps does: it adds nothing, and counts once.
    reuse = run.event("reuse")
    assert reuse["rc"] == 0 and reuse["driver"]["pool_used"] == size, reuse
    assert reuse["status"]["used_bytes"] == CONTEXT + 3 * size, reuse
    trimmed = run.event("trimmed")
    assert trimmed["driver"]["pool_reserved"] == 0
    assert trimmed["status"]["used_bytes"] == CONTEXT, trimmed
    assert run.event("alloc_after_trim")["rc"] == 0


@pytest.mark.parametrize(
    "scenario", [("pool", "current", 1, 256 * MiB, 3), ("graph", 400 * MiB, 2)]
)
def test_reserves_are_counted_on_the_device_they_are_on(harness, reserves_probe, scenario):
    # Everything on device 1 of two: the device's own pools and graph pool are asked.
    extra = {"RESERVES_DEVICE": "1", "GPUSHARE_FAKE_DEVICES": "2"}
    run = probe(harness, reserves_probe, *scenario, extra=extra)
    step = run.event("freed")
    held = step["driver"]["pool_reserved"] + step["driver"]["graph_reserved"]
    assert held == (768 * MiB if scenario[0] == "pool" else 800 * MiB), step
    assert step["status"]["used_bytes"] == CONTEXT + held, step
    assert run.event("trimmed")["status"]["used_bytes"] == CONTEXT


def test_memory_a_pool_gives_back_is_not_counted(harness, reserves_probe):
    # Release threshold 0 (the driver's default): the pool keeps nothing after the frees.
    run = probe(harness, reserves_probe, "pool", "current", 0, 256 * MiB, 3)
    freed = run.event("freed")
    assert freed["driver"]["pool_reserved"] == 0
    assert freed["status"]["used_bytes"] == CONTEXT, freed
    assert run.event("alloc_after_free")["rc"] == 0
    assert not quota_lines(run), run.stderr


def test_an_alloc_node_past_the_quota_is_refused(harness, reserves_probe):
    run = probe(harness, reserves_probe, "allocnode", 2 * GiB)
    assert run.event("node")["rc"] == OOM
    assert len(quota_lines(run)) == 1, run.stderr
    # A node that fits is made, and costs nothing until a launch backs it.
    fits = probe(harness, reserves_probe, "allocnode", 512 * MiB)
    node = fits.event("node")
    assert node["rc"] == 0 and node["status"]["used_bytes"] == CONTEXT, node


def test_a_graph_launch_past_the_quota_is_refused_before_the_driver_backs_it(
    harness, reserves_probe
):
    # Three 400 MiB nodes: each fits a 1 GiB quota, together they do not.
    run = probe(harness, reserves_probe, "graph", 400 * MiB, 3)
    assert run.event("instantiated")["rc"] == 0
    launched = run.event("launched")
    assert launched["rc"] == OOM
    assert launched["driver"]["graph_reserved"] == 0, "the driver backed a refused launch"
    assert launched["status"]["used_bytes"] == CONTEXT, launched
    assert len(quota_lines(run)) == 1, run.stderr
    assert run.stats["graph_launches"] == 0


def test_a_launched_graphs_memory_counts_until_the_graph_pool_is_trimmed(harness, reserves_probe):
    size = 400 * MiB
    run = probe(harness, reserves_probe, "graph", size, 2)
    launched = run.event("launched")
    assert launched["rc"] == 0
    assert launched["driver"]["graph_reserved"] == 2 * size
    assert launched["status"]["used_bytes"] == CONTEXT + 2 * size, launched
    assert launched["status"]["pinned_bytes"] == CONTEXT + 2 * size, launched
    # Freed, the graph pool keeps the memory: still the process's.
    freed = run.event("freed")
    assert freed["driver"]["graph_used"] == 0 and freed["driver"]["graph_reserved"] == 2 * size
    assert freed["status"]["used_bytes"] == CONTEXT + 2 * size, freed
    trimmed = run.event("trimmed")
    assert trimmed["driver"]["graph_reserved"] == 0
    assert trimmed["status"]["used_bytes"] == CONTEXT, trimmed


def test_a_captured_allocation_counts_once_as_graph_memory_when_launched(harness, reserves_probe):
    size = 512 * MiB
    run = probe(harness, reserves_probe, "capture", size, 0, 1)
    captured = run.event("captured_alloc")
    assert captured["rc"] == 0
    # During the capture the allocation has no memory: not counted (not as pool memory either).
    assert captured["status"]["used_bytes"] == CONTEXT, captured
    assert run.event("instantiated")["status"]["used_bytes"] == CONTEXT
    launched = run.event("launched")
    assert launched["rc"] == 0 and launched["driver"]["graph_reserved"] == size
    assert launched["status"]["used_bytes"] == CONTEXT + size, "counted twice or not at all"
    freed = run.event("freed")
    assert freed["rc"] == 0 and freed["status"]["used_bytes"] == CONTEXT + size, freed
    trimmed = run.event("trimmed")
    assert trimmed["status"]["used_bytes"] == CONTEXT, trimmed
    # The capture itself went through the shim's capture hooks untouched.
    captures = run.stats["captures"]
    assert captures["ended"] == 1 and captures["invalidated"] == 0, captures
    assert captures["unsafe_calls"] == 0, captures


def test_a_graph_that_frees_what_it_allocates_relaunches_within_its_memory(harness, reserves_probe):
    size = 512 * MiB
    run = probe(harness, reserves_probe, "capture", size, 1, 5)
    launched = run.event("launched")
    assert launched["rc"] == 0 and launched["ok"] == 5, launched
    assert launched["driver"]["graph_reserved"] == size and launched["driver"]["graph_used"] == 0
    assert launched["status"]["used_bytes"] == CONTEXT + size, launched
    assert not quota_lines(run), run.stderr


def test_an_auto_free_graph_relaunches_without_counting_its_memory_again(harness, reserves_probe):
    # PyTorch instantiates with AUTO_FREE_ON_LAUNCH: each relaunch frees what the last one
    # allocated, so the allocation (never freed in the graph) does not grow with relaunches.
    size = 600 * MiB
    run = probe(harness, reserves_probe, "capture", size, 0, 4, 1)
    launched = run.event("launched")
    assert launched["rc"] == 0 and launched["ok"] == 4, (launched, run.stderr)
    assert launched["driver"]["graph_used"] == size
    assert launched["status"]["used_bytes"] == CONTEXT + size, launched
    assert not quota_lines(run), run.stderr
    # Without the flag the driver refuses a relaunch whose allocation is still live.
    plain = probe(harness, reserves_probe, "capture", size, 0, 4, 0)
    assert plain.event("launched")["ok"] == 1


def test_a_graph_allocation_freed_outside_its_graph_leaves_room_for_the_next_launch(
    harness, reserves_probe
):
    # PyTorch frees a graph's output tensor with cudaFreeAsync, outside the graph: the graph pool
    # keeps the memory idle (still counted) and serves the next launch from it. 600 MiB then
    # 800 MiB under 1 GiB: 64 + 800 MiB fits; 64 + 600 + 800 MiB (the freed 600 MiB taken for
    # still in use) would not.
    first, second = 600 * MiB, 800 * MiB
    run = probe(harness, reserves_probe, "regraph", first, second)
    assert run.event("first_launched")["status"]["used_bytes"] == CONTEXT + first
    freed = run.event("freed_outside")
    assert freed["rc"] == 0 and freed["driver"]["graph_used"] == 0, freed
    assert freed["driver"]["graph_reserved"] == first, freed
    assert freed["status"]["used_bytes"] == CONTEXT + first, "the idle graph pool is not counted"
    second_launch = run.event("second_launched")
    assert second_launch["rc"] == 0, (second_launch, run.stderr)
    assert not quota_lines(run), run.stderr
    assert second_launch["driver"]["graph_reserved"] == second, second_launch
    assert second_launch["status"]["used_bytes"] == CONTEXT + second, second_launch


@pytest.mark.parametrize("destroy_first", [0, 1])
def test_dropping_the_output_of_a_refused_launch_does_not_fail(
    harness, reserves_probe, destroy_first
):
    # 512 MiB captured, then 512 MiB by cuMemAlloc: the launch (64 + 512 + 512 MiB) is refused.
    # Its allocation has an address and no memory; the driver refuses to free it
    # (CUDA_ERROR_INVALID_VALUE, which PyTorch's deleter turns into a terminate). Dropping it
    # must succeed, whether the graph is destroyed before or after, and change no count.
    size = 512 * MiB
    run = probe(harness, reserves_probe, "unbacked", size, size, destroy_first)
    refused = run.event("refused")
    assert refused["rc"] == OOM and len(quota_lines(run)) == 1, (refused, run.stderr)
    dropped = run.event("dropped")
    assert dropped["rc"] == 0, dropped
    assert dropped["driver"]["graph_reserved"] == 0, dropped
    assert dropped["status"]["used_bytes"] == CONTEXT + size, dropped
    # A graph that ran: its allocation has memory, and its free reaches the driver.
    launched = run.event("launched")
    assert launched["rc"] == 0 and launched["status"]["used_bytes"] == CONTEXT + size, launched
    freed = run.event("freed")
    assert freed["rc"] == 0 and freed["driver"]["graph_used"] == 0, freed
    assert run.event("trimmed")["status"]["used_bytes"] == CONTEXT


def test_a_captured_allocation_past_the_quota_is_refused(harness, reserves_probe):
    run = probe(harness, reserves_probe, "capture", 2 * GiB, 0, 1)
    assert run.event("captured_alloc")["rc"] == OOM
    assert len(quota_lines(run)) == 1, run.stderr


def test_the_scheduler_sees_a_pools_reserve_as_pinned(harness, reserves_probe):
    size = 256 * MiB
    sched = harness.scheduler(pool="4GiB")
    proc = spawn_probe(
        harness,
        reserves_probe,
        "pool",
        "current",
        1,
        size,
        3,
        5,
        context_bytes=CONTEXT,
        memory_limit=QUOTA,
        client_id="R",
    )
    proc.wait_event("holding", 30)
    entry: dict[str, Any] = {}
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        clients = [c for d in sched.status()["devices"] for c in d["clients"] if c["id"] == "R"]
        entry = clients[0] if clients else {}
        if entry.get("used_bytes") == CONTEXT + 3 * size:
            break
        time.sleep(0.1)
    # Every allocation was freed; what the scheduler sees is the pool's reserve, not evictable.
    assert entry.get("used_bytes") == CONTEXT + 3 * size, entry
    assert entry.get("pinned_bytes") == CONTEXT + 3 * size, entry
    run = proc.finish(30).ok()
    assert run.event("freed")["driver"]["pool_used"] == 0
