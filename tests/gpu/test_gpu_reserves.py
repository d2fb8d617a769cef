"""Memory the driver keeps outside allocations, on a real GPU (issue 12 fault 5): PyTorch's
cudaMallocAsync pool keeps what it frees (release threshold at the maximum) and CUDA graphs back
their captured allocations from the graph pool at replay. Under a 2 GiB quota the shim's count
must equal what the driver says the pool and the graph pool hold, the scheduler must see it as
pinned, and going past the quota through either must fail with the shim's line. A refused replay
leaves the graph's allocation without memory, which the real driver refuses to free
(cudaErrorInvalidValue, a terminate in PyTorch's deleter: the first run on the H100 died so);
dropping that output must succeed, and once room is made a replay of the same size runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import WORKLOADS, Scheduler, require, shimmed_env

MIB = 1 << 20
CONTEXT = 512 * MIB
# Pool allocations are counted at their requested size, the driver's "used" is rounded up to its
# own granularity; a few small tensors (and cuBLAS's workspace) make the difference.
SLACK = 32 * MIB


def accounted(rec: dict[str, Any]) -> tuple[int, int]:
    """(what the shim counts beyond the context, what the driver says the pools hold)."""
    drv = rec["driver"]
    return rec["shim"]["used_bytes"] - CONTEXT, drv["pool_reserved"] + drv["graph_reserved"]


def test_pool_reserves_and_graph_memory_count_against_the_quota(
    scheduler: Scheduler, tmp_path: Path
) -> None:
    require("torch")
    env = shimmed_env(
        scheduler.socket,
        {
            "GPUSHARE_MEMORY_LIMIT": "2GiB",
            "GPUSHARE_CONTEXT_BYTES": "512MiB",
            "GPUSHARE_CLIENT_ID": "reserves",
            "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
        },
    )
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:  # read at the end: a full pipe would block the workload
        proc = subprocess.Popen(
            [sys.executable, str(WORKLOADS / "torch_reserves.py"), "4"],
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            env=env,
        )
    assert proc.stdout is not None
    phases: dict[str, dict[str, Any]] = {}
    seen: dict[str, Any] = {}
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        phases[rec["phase"]] = rec
        if rec["phase"] == "freed":
            # The workload holds 4 s here: what does the scheduler see of this client?
            time.sleep(1.5)
            for dev in scheduler.status()["devices"]:
                for c in dev["clients"]:
                    if c["id"] == "reserves":
                        seen = c
    proc.wait(timeout=300)
    err = stderr.read_text()
    assert proc.returncode == 0, (err, phases)
    assert phases["start"]["backend"] == "cudaMallocAsync", phases["start"]
    lines = [ln for ln in err.splitlines() if ln.startswith("gpushare: out of memory")]

    for name in (
        "allocated",
        "freed",
        "alloc_after_free",
        "trimmed",
        "replayed",
        "dropped_refused",
        "room_made",
        "replayed_after_room",
        "graph_trimmed",
    ):
        shim, driver = accounted(phases[name])
        assert abs(shim - driver) <= SLACK, (name, shim, driver, phases[name])

    assert phases["allocated"]["sums_ok"]
    freed = phases["freed"]
    # Everything was freed, and the pool kept it: the shim still counts it, as pinned.
    assert freed["driver"]["pool_reserved"] >= 768 * MIB, freed
    assert freed["shim"]["pinned_bytes"] >= CONTEXT + 768 * MIB, freed
    assert seen, "the workload's client is not in the scheduler's status"
    assert seen["used_bytes"] >= CONTEXT + 768 * MIB, seen
    assert seen["pinned_bytes"] >= CONTEXT + 768 * MIB, seen
    # 1 GiB more through cuMemAlloc fits the quota only if the reserve is not counted.
    assert phases["alloc_after_free"]["rc"] == 2, phases["alloc_after_free"]
    trimmed = phases["trimmed"]
    assert trimmed["driver"]["pool_reserved"] < 64 * MIB, trimmed
    assert trimmed["rc"] == 0, "after the trim the same allocation must fit"

    replayed = phases["replayed"]
    assert replayed["ok"], replayed
    assert replayed["driver"]["graph_reserved"] >= 640 * MIB, replayed
    over = phases["replay_over_quota"]
    assert "out of memory" in over["error"], over
    assert over["driver"]["graph_reserved"] < 1600 * MIB, "the driver backed the refused replay"
    # The refused graph's output dropped (the process is alive to say so): it had no memory, so
    # nothing is counted for it and the driver's graph pool holds only g1's 640 MiB.
    dropped = phases["dropped_refused"]
    assert dropped["driver"]["graph_reserved"] == replayed["driver"]["graph_reserved"], dropped
    assert phases["usable_after_refusal"]["ok"], "the process was not usable after the refusal"
    # Room made (g1's output dropped, synchronised, the graph pool trimmed): no graph uses any
    # graph memory, and the trim gives back every block no graph uses, so none is left and none
    # is counted; what remains is the context and the pool's remainder (the 64 MiB of "trimmed").
    # A replay of the refused size (g3, 1 GiB) then fits (0.5 + 1 GiB) and computes; counted.
    room = phases["room_made"]
    assert room["driver"]["graph_reserved"] == 0, room
    assert room["shim"]["used_bytes"] < CONTEXT + 64 * MIB, room
    after = phases["replayed_after_room"]
    assert after["ok"], after
    assert after["driver"]["graph_reserved"] >= 1024 * MIB, after
    assert after["shim"]["used_bytes"] >= CONTEXT + 1024 * MIB, after
    # Everything dropped and trimmed: the count is back to the context and the pool's remainder.
    done = phases["graph_trimmed"]
    assert done["driver"]["graph_reserved"] == 0, done
    assert done["shim"]["used_bytes"] < CONTEXT + 64 * MIB, done
    assert len(lines) >= 2 and all("quota of 2.00 GiB" in ln for ln in lines), err
    print(
        "pool kept {:.0f} MiB after frees, counted {:.0f} MiB; graph pool {:.0f} MiB, counted "
        "{:.0f} MiB; scheduler saw {:.0f} MiB pinned".format(
            freed["driver"]["pool_reserved"] / MIB,
            accounted(freed)[0] / MIB,
            replayed["driver"]["graph_reserved"] / MIB,
            accounted(replayed)[0] / MIB,
            seen["pinned_bytes"] / MIB,
        )
    )
    for ln in lines:
        print(ln)
