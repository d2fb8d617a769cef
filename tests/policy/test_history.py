"""The scheduler's history (jupyter_gpushare/scheduler/features/history.py): what it keeps of status
documents, and its bounds (points per series, the window, the number of kernels), on times the
test passes (the module has no clock)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare.scheduler.features.history import History

MiB = 1 << 20


def client(cid: str, user: str, state: str, used: int, evicted: int = 0, **kw: Any) -> dict:
    return {
        "id": cid,
        "user": user,
        "label": f"/home/{user}/{cid}.ipynb",
        "state": state,
        "used_bytes": used,
        "evicted_bytes": evicted,
        "gpu_seconds": kw.get("gpu", 0.0),
        "wait_seconds": kw.get("wait", 0.0),
    }


def doc(*clients: dict, util: int | None = 40) -> dict:
    return {
        "devices": [
            {
                "uuid": "GPU-1",
                "pool_bytes": 1024 * MiB,
                "resident_bytes": 300 * MiB,
                "holders": [c["id"] for c in clients if c["state"] == "running"],
                "queue": [c["id"] for c in clients if c["state"] == "waiting"],
                "utilization_percent": util,
                "clients": list(clients),
            }
        ]
    }


def test_kernels_users_and_devices_over_time() -> None:
    h = History(window=3600, resolution=5)
    h.record(1000.0, doc(client("a", "alice", "running", 200 * MiB, gpu=1.0)))
    h.record(1010.0, doc(
        client("a", "alice", "idle", 200 * MiB, 150 * MiB, gpu=9.5),
        client("b", "alice", "running", 100 * MiB, gpu=2.0, wait=4.0),
        client("c", "bob", "waiting", 50 * MiB, wait=3.0),
    ))  # fmt: skip
    view = h.view(1012.0)
    assert view["window_seconds"] == 3600 and view["resolution_seconds"] == 5
    a = view["kernels"]["a"]
    assert a["user"] == "alice" and a["label"] == "/home/alice/a.ipynb" and a["device"] == "GPU-1"
    assert a["points"] == [
        [1000.0, 200 * MiB, 0, 1.0, 0.0, "running"],
        [1010.0, 50 * MiB, 150 * MiB, 9.5, 0.0, "idle"],
    ]
    assert view["kernels"]["c"]["points"] == [[1010.0, 50 * MiB, 0, 0.0, 3.0, "waiting"]]
    # A user's point sums their kernels at that moment.
    assert view["users"]["alice"]["points"][-1] == [1010.0, 150 * MiB, 150 * MiB, 11.5, 4.0, 2]
    assert view["users"]["bob"]["points"] == [[1010.0, 50 * MiB, 0, 0.0, 3.0, 1]]
    assert view["devices"]["GPU-1"]["points"][-1] == [1010.0, 40, 300 * MiB, 1024 * MiB, 1, 1]
    # Asked for some kernels and users only (what a viewer may see).
    mine = h.view(1012.0, kernels=["a", "b"], users=["alice"])
    assert set(mine["kernels"]) == {"a", "b"} and set(mine["users"]) == {"alice"}
    assert set(mine["devices"]) == {"GPU-1"}


def test_events_closer_than_the_resolution_replace_the_last_point() -> None:
    h = History(window=60, resolution=5)
    for i in range(10):  # ten events within 4.5 s: one point, the latest
        h.record(100.0 + i * 0.5, doc(client("a", "u", "running", i * MiB, gpu=float(i))))
    points = h.view(105.0)["kernels"]["a"]["points"]
    assert points == [[104.5, 9 * MiB, 0, 9.0, 0.0, "running"]]
    h.record(110.0, doc(client("a", "u", "idle", 9 * MiB)))
    assert len(h.view(110.0)["kernels"]["a"]["points"]) == 2


def test_the_window_drops_old_points_and_gone_kernels() -> None:
    h = History(window=60, resolution=5)
    h.record(0.0, doc(client("old", "u", "running", MiB)))
    for t in range(10, 100, 10):
        h.record(float(t), doc(client("a", "u", "running", MiB)))
    view = h.view(100.0)
    assert "old" not in view["kernels"]  # last seen 100 s ago, past the 60 s window
    assert [p[0] for p in view["kernels"]["a"]["points"]] == [40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
    assert view["devices"]["GPU-1"]["points"][0][0] == 40.0
    assert h.view(200.0)["kernels"] == {}


def test_view_thins_long_series_keeping_the_newest_point() -> None:
    h = History(window=3600, resolution=1)
    for t in range(1000):
        h.record(float(t), doc(client("a", "u", "running", t)))
    points = h.view(999.0, max_points=50)["kernels"]["a"]["points"]
    assert len(points) == 50 and points[-1][0] == 999.0 and points[0][0] == 0.0
    assert [p[0] for p in points] == sorted(p[0] for p in points)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        History(window=0)
    with pytest.raises(ValueError):
        History(resolution=-1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=50, allow_nan=False),  # time step
            st.lists(st.sampled_from("abcdefgh"), max_size=6, unique=True),  # who is there
        ),
        max_size=80,
    )
)
def test_bounds_hold_for_any_sequence(steps: list[tuple[float, list[str]]]) -> None:
    h = History(window=100, resolution=5, max_series=4)
    now = 0.0
    for step, ids in steps:
        now += step
        h.record(now, doc(*(client(i, f"user-{i}", "running", MiB) for i in ids)))
        view = h.view(now, max_points=1000)
        assert len(view["kernels"]) <= 4
        for table in ("kernels", "users", "devices"):
            for series in view[table].values():
                times = [p[0] for p in series["points"]]
                assert len(times) <= 100 / 5 + 1
                assert all(now - 100 <= t <= now for t in times)
                assert times == sorted(times)
                assert all(b - a >= 5 for a, b in itertools.pairwise(times))
