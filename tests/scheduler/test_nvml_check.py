"""Memory claims against NVML's per-process figures (features/nvml_check.py): pure decisions."""

from __future__ import annotations

from jupyter_gpushare.scheduler.features.nvml_check import (
    ClientClaim,
    ProcessMemory,
    corrected,
    observed,
    pids_comparable,
    under_claim,
    unmanaged,
)

GiB = 1 << 30
DEV = "gpu-aaaa"


def _claim(client: str, pid: int, used: int, uid: int = 1001, device: str = DEV) -> ClientClaim:
    return ClientClaim(client, device, pid, uid, used)


def test_an_under_claim_counts_as_what_nvml_sees_and_the_rest_is_pinned() -> None:
    seen = observed([_claim("liar", 42, 0)], [ProcessMemory(DEV, 42, 3 * GiB, 1001)])
    assert seen == {"liar": 3 * GiB}
    claim = {"used": 0, "managed": 0, "pinned": 0, "evicted": 0}
    assert corrected(claim, seen["liar"]) == {
        "used": 3 * GiB,
        "managed": 0,
        "pinned": 3 * GiB,
        "evicted": 0,
    }


def test_a_claim_above_what_nvml_sees_stands() -> None:
    # Evicted managed memory is off the device: NVML sees less than the claim, which stands.
    claim = {"used": 4 * GiB, "managed": 3 * GiB, "pinned": GiB, "evicted": 3 * GiB}
    seen = observed([_claim("k", 42, 4 * GiB)], [ProcessMemory(DEV, 42, GiB, 1001)])
    assert corrected(claim, seen["k"]) == claim


def test_a_context_larger_than_its_estimate_counts_in_full() -> None:
    # The claim's context is an estimate (512 MiB); NVML's figure has the real one: no discount.
    claim = {"used": (1 << 29) + GiB, "managed": GiB, "pinned": 1 << 29, "evicted": 0}
    real = GiB + (600 << 20)
    got = corrected(claim, real)
    assert got["used"] == real and got["pinned"] == (1 << 29) + real - claim["used"]
    assert got["managed"] == GiB


def test_a_pid_of_another_uid_another_device_or_unknown_is_not_the_client() -> None:
    procs = [ProcessMemory(DEV, 42, 3 * GiB, 2002), ProcessMemory("gpu-bbbb", 43, 3 * GiB, 1001)]
    claims = [_claim("reused-pid", 42, 0), _claim("other-gpu", 43, 0), _claim("no-pid", 0, 0)]
    claims.append(_claim("not-listed", 44, 0))
    assert observed(claims, procs) == {
        "reused-pid": 0,
        "other-gpu": 0,
        "no-pid": 0,
        "not-listed": 0,
    }


def test_clients_sharing_a_process_share_its_figure() -> None:
    # Two connections of one process on one device: NVML's one figure is theirs together.
    procs = [ProcessMemory(DEV, 42, 5 * GiB, 1001)]
    honest = observed([_claim("a", 42, 2 * GiB), _claim("b", 42, 3 * GiB)], procs)
    assert corrected({"used": 2 * GiB, "pinned": 0}, honest["a"])["used"] == 2 * GiB
    assert honest["b"] == 0
    liars = observed([_claim("a", 42, 0), _claim("b", 42, 0)], procs)
    assert liars == {"a": 5 * GiB, "b": 0}  # counted once, not once per connection


def test_pids_are_comparable_only_in_the_initial_pid_namespace() -> None:
    assert pids_comparable("Name:\tpython\nNSpid:\t4242\nNSpgid:\t4242\n")
    assert not pids_comparable("Name:\tpython\nNSpid:\t4242\t17\n")  # in a container
    assert not pids_comparable("Name:\tpython\n")  # a kernel that does not say


def test_an_under_claim_the_context_explains_is_told_from_a_lie() -> None:
    estimate = 512 << 20
    assert under_claim(2 * GiB, 2 * GiB, estimate) == 0
    assert under_claim(2 * GiB, GiB, estimate) == 0  # evicted: NVML sees less
    assert under_claim(2 * GiB, 2 * GiB + (88 << 20), estimate) == 1  # a 600 MiB context
    assert under_claim(0, 3 * GiB, estimate) == 2  # used = 0 with 3 GiB on the GPU


def test_memory_claimed_evicted_that_nvml_sees_on_the_device_is_pinned() -> None:
    # A14d: all 3 GiB "on the host", NVML sees 3 GiB on the card: off its turn it counts 3 GiB.
    claim = {"used": 3 * GiB, "managed": 3 * GiB, "pinned": 0, "evicted": 3 * GiB}
    assert corrected(claim, 3 * GiB) == {
        "used": 3 * GiB,
        "managed": 3 * GiB,
        "pinned": 3 * GiB,
        "evicted": 0,
    }
    # Honest: evicted, NVML sees its context and pinned part only; the claim stands.
    honest = {"used": 4 * GiB, "managed": 3 * GiB, "pinned": GiB // 2, "evicted": 3 * GiB}
    assert corrected(honest, GiB) == honest
    # A reading taken before its eviction says nothing of its residency: only "used" is checked.
    assert corrected(claim, 3 * GiB, residency=False) == claim


def test_processes_of_no_client_are_unmanaged() -> None:
    claims = [_claim("k", 42, GiB)]
    procs = [
        ProcessMemory(DEV, 42, GiB, 1001),  # the client's
        ProcessMemory(DEV, 43, 3 * GiB, 1002),  # never registered
        ProcessMemory(DEV, 42, GiB, 1002),  # not possible twice, but: another uid is not it
        ProcessMemory("gpu-bbbb", 42, 2 * GiB, 1001),  # the client's process on another GPU
        ProcessMemory(DEV, 44, 0, 1002),  # nothing held
    ]
    got = unmanaged(claims, procs)
    assert {d: [(p.pid, p.uid) for p in ps] for d, ps in got.items()} == {
        DEV: [(43, 1002), (42, 1002)],
        "gpu-bbbb": [(42, 1001)],
    }
