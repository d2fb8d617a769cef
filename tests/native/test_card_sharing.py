"""Issue 34 on the stand-in's one card (GPUSHARE_FAKE_CARD_FILE): several processes whose memory
together passes the card, at the default pool (the card less a small ``--reserve``), as users meet
it. Before the fix the scheduler's room counted an idle kernel's memory as free: a newcomer
granted beside an idle notebook backed its next big allocation into that room and the driver (the
card) refused it, so the notebook's cell got CUDA out of memory (H200, e5353ea). Here the card
itself refuses what does not fit, for every process together, and records its peak."""

from __future__ import annotations

from tests.native.card_file import read_card

MiB = 1 << 20
GiB = 1 << 30
CARD = 1 * GiB
CONTEXT = 64 * MiB
ON_CARD = {"GPUSHARE_FAKE_DEVICE_TOTAL": str(CARD)}


def common(client: str, idle_seconds: float = 0.5) -> dict:
    return {
        "context_bytes": CONTEXT,
        "idle_seconds": idle_seconds,
        "log": "info",
        "client_id": client,
        "extra": ON_CARD,
    }


def default_pool(harness, quantum: float = 2.0):
    """A scheduler at its default pool: the card (learnt from the shims' HELLO) less 64 MiB."""
    return harness.scheduler(pool="", quantum=quantum, args=("--reserve", "64MiB"))


def test_a_newcomer_granted_beside_an_idle_notebook_grows_past_it_without_out_of_memory(harness):
    """A holds 600 MiB and goes idle; B is granted beside it with nothing but its context, then
    allocates 600 MiB (together past the 1 GiB card). B's allocation waits unbacked, A's memory
    leaves for it (a pre-copied unmap), B runs; A's next cell gets its data back, exact."""
    sched = default_pool(harness)
    a = harness.spawn("precopy_cycle", 600 * MiB, 8.0, 0.3, 0.3, **common("A"))
    a.wait_event("idle1_start", 30)
    # B's idle window outlasts its first fill (the stand-in's memset is real memory, slow on a
    # loaded host): B is busy, not idle, while it writes.
    b = harness.spawn("grow", 0.3, 600 * MiB, 0.5, **common("B", idle_seconds=5))
    rb = b.finish(90)
    assert rb.returncode == 0, rb.describe()  # before: cuMemsetD8 failed with out of memory
    assert rb.event("hold_end")["data_ok"]
    ra = a.finish(90).ok()
    assert ra.event("cycle_end")["data_ok"]
    card = read_card(harness.card_file)
    # The card never held more than it has, and never had to refuse: the room kept B unbacked
    # until A's memory had left.
    assert card.devices[0].peak <= CARD, card
    assert card.devices[0].refused == 0, card
    assert "evicted client=A" in sched.log or "revoke client=A" in sched.log, sched.log
    assert "revoke client=B reason='memory grew past the pool'" not in sched.log, sched.log


def test_three_processes_past_the_card_take_turns_and_all_finish_exact(harness):
    """Three processes of 400 MiB (1.2 GiB on a 1 GiB card, plus contexts): two fit at a time;
    the third waits for a turn. All finish with their data, the card is never passed, and no
    allocation or copy is refused by the card."""
    sched = default_pool(harness, quantum=0.5)
    procs = [
        harness.spawn("hold", 1.5, 400 * MiB, 20000, **common(f"p{i}", idle_seconds=5))
        for i in range(3)
    ]
    runs = [p.finish(120) for p in procs]
    for r in runs:
        assert r.returncode == 0, r.describe()
        assert r.event("hold_end")["data_ok"]
    card = read_card(harness.card_file)
    assert card.devices[0].peak <= CARD, card
    assert card.devices[0].refused == 0, card
    assert "out of memory" not in "".join(r.stderr for r in runs).lower()
    assert sched.log  # the scheduler ran the turns (its log names each grant)
