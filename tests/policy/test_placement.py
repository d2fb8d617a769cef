"""The placement rule (jupyter_gpushare/scheduler/features/placement.py).

Which GPU a new kernel goes to.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare.scheduler.features.placement import (
    DeviceLoad,
    PlacementError,
    choose_device,
    committed_bytes,
    device_loads,
    resolve_device,
)

GiB = 1 << 30
U0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
U1 = "GPU-bbbbbbbb-0000-0000-0000-000000000001"
U2 = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


def load(uuid: str, index: int | None, pool: int, committed: int, clients: int = 0) -> DeviceLoad:
    return DeviceLoad(uuid, index, pool, committed, clients)


def test_committed_is_use_or_expectation_whichever_is_larger() -> None:
    assert committed_bytes(used=0, quota=0, estimate=GiB) == GiB  # no quota: the estimate
    assert committed_bytes(used=3 * GiB, quota=0, estimate=GiB) == 3 * GiB  # grew past it
    assert committed_bytes(used=GiB, quota=8 * GiB, estimate=GiB) == 8 * GiB  # may grow to quota
    assert committed_bytes(used=9 * GiB, quota=8 * GiB, estimate=GiB) == 9 * GiB


def test_loads_from_the_status_document_and_reservations() -> None:
    devices = [
        {
            "uuid": U0,
            "index": 0,
            "pool_bytes": 10 * GiB,
            "clients": [
                {"used_bytes": 2 * GiB, "quota_bytes": 0},
                {"used_bytes": 0, "quota_bytes": 4 * GiB},
            ],
        },
        {"uuid": U1, "index": None, "pool_bytes": 10 * GiB, "clients": []},
    ]
    loads = device_loads(devices, [(U1.upper(), 3 * GiB), (U1, GiB)], estimate=GiB)
    assert loads[0] == DeviceLoad(U0, 0, 10 * GiB, 6 * GiB, 2)
    assert loads[1] == DeviceLoad(U1, None, 10 * GiB, 4 * GiB, 2)  # reservations, any case
    assert loads[1].free_bytes == 6 * GiB


def test_most_free_room_wins_then_fewer_kernels_then_lower_index() -> None:
    a = load(U0, 0, 10 * GiB, 6 * GiB, 1)
    b = load(U1, 1, 10 * GiB, 2 * GiB, 3)
    assert choose_device([a, b], GiB).uuid == U1  # 8 GiB free beats 4 GiB, kernels or not
    c = load(U1, 1, 10 * GiB, 6 * GiB, 0)
    assert choose_device([a, c], GiB).uuid == U1  # same room: fewer kernels
    d = load(U1, 1, 10 * GiB, 6 * GiB, 1)
    assert choose_device([d, a], GiB).uuid == U0  # same room and kernels: lower index


def test_a_kernel_goes_where_it_fits_even_to_a_fuller_device() -> None:
    small = load(U0, 0, 4 * GiB, 0, 0)  # 4 GiB free
    big = load(U1, 1, 80 * GiB, 74 * GiB, 5)  # 6 GiB free
    placed = choose_device([small, big], 5 * GiB)
    assert placed.uuid == U1 and placed.fits and placed.reason == "the only GPU it fits"


def test_fits_nowhere_goes_to_the_least_committed_device() -> None:
    a = load(U0, 0, 10 * GiB, 9 * GiB)
    b = load(U1, 1, 10 * GiB, 12 * GiB)  # already over-committed
    placed = choose_device([a, b], 4 * GiB)
    assert placed.uuid == U0 and not placed.fits and placed.free_bytes == GiB


def test_pins_by_index_uuid_and_prefix() -> None:
    devices = [load(U0, 0, 10 * GiB, 0), load(U1, 1, 10 * GiB, 9 * GiB), load(U2, 2, GiB, 0)]
    assert choose_device(devices, 4 * GiB, pin=1).uuid == U1
    placed = choose_device(devices, 4 * GiB, pin="1")
    assert placed.reason == "pinned" and not placed.fits  # pinned even where it does not fit
    assert choose_device(devices, 0, pin=U2.lower()).uuid == U2
    assert choose_device(devices, 0, pin=" " + U0.upper()).uuid == U0
    assert resolve_device(devices, "GPU-aaaaaaaa").uuid == U0  # a unique prefix
    assert resolve_device(devices, "aaaaaaaa-0000").uuid == U0  # "GPU-" may be left out
    with pytest.raises(PlacementError, match="matches 2 devices"):
        resolve_device(devices, "GPU-bbbbbbbb")
    with pytest.raises(PlacementError, match="no device with index 7"):
        resolve_device(devices, 7)
    with pytest.raises(PlacementError, match="no device 'GPU-cc'"):
        resolve_device(devices, "GPU-cc")  # too short to be a prefix
    with pytest.raises(PlacementError):
        resolve_device(devices, True)  # type: ignore[arg-type]
    assert choose_device(devices, 0, pin="").uuid == U0  # an empty pin is no pin


def test_only_reachable_devices_are_candidates() -> None:
    devices = [load(U0, 0, 10 * GiB, 0), load(U1, 1, 10 * GiB, 9 * GiB)]
    placed = choose_device(devices, GiB, reachable=[U1.upper()])  # a server given only GPU 1
    assert placed.uuid == U1 and placed.fits
    with pytest.raises(PlacementError, match="no device with index 0"):
        choose_device(devices, GiB, pin=0, reachable=[U1])  # a pin outside them names nothing
    with pytest.raises(PlacementError, match="none of the GPUs the kernel can reach"):
        choose_device(devices, GiB, reachable=["GPU-elsewhere"])
    assert choose_device(devices, GiB, reachable=None).uuid == U0


def test_no_device_is_an_error() -> None:
    with pytest.raises(PlacementError, match="no GPU"):
        choose_device([], GiB)


@st.composite
def node(draw: st.DrawFn) -> list[DeviceLoad]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        pool = draw(st.integers(1, 80)) * GiB
        out.append(
            DeviceLoad(
                f"GPU-{i:08x}-0000-0000-0000-000000000000",
                draw(st.one_of(st.none(), st.just(i))),
                pool,
                draw(st.integers(0, 100)) * GiB,
                draw(st.integers(0, 5)),
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(node(), st.integers(0, 90 * GiB))
def test_properties(devices: list[DeviceLoad], need: int) -> None:
    placed = choose_device(devices, need)
    chosen = next(d for d in devices if d.uuid == placed.uuid)
    fitting = [d for d in devices if need <= d.free_bytes]
    # Never a device it cannot fit when another fits; the answer says whether it fits.
    assert placed.fits == bool(fitting) == (need <= chosen.free_bytes)
    # The most free room among the candidates; fewer kernels among equals.
    candidates = fitting or devices
    assert chosen.free_bytes == max(d.free_bytes for d in candidates)
    equals = [d for d in candidates if d.free_bytes == chosen.free_bytes]
    assert chosen.clients == min(d.clients for d in equals)
    # Deterministic: the order the devices are listed in does not matter, unless two are equal
    # in every key (room, kernels, index).
    same = [
        d
        for d in candidates
        if (d.free_bytes, d.clients, d.index) == (chosen.free_bytes, chosen.clients, chosen.index)
    ]
    if len(same) == 1:
        assert choose_device(list(reversed(devices)), need).uuid == placed.uuid


@settings(max_examples=200, deadline=None)
@given(node(), st.lists(st.integers(0, 20 * GiB), min_size=1, max_size=12))
def test_reserving_each_placement_spreads_kernels(devices: list[DeviceLoad], needs: list[int]):
    """Placing kernels one after another, each reserving its need where it went (what the
    scheduler does for concurrent starts), never puts a kernel on a device where it does not fit
    while another device had room for it."""
    current = list(devices)
    for need in needs:
        placed = choose_device(current, need)
        assert placed.fits == any(need <= d.free_bytes for d in current)
        current = [
            DeviceLoad(d.uuid, d.index, d.pool_bytes, d.committed_bytes + need, d.clients + 1)
            if d.uuid == placed.uuid
            else d
            for d in current
        ]
