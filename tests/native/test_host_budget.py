"""Host memory is a budget (docs/architecture.md): three processes whose memory passes the card
take turns at the default pool (the whole card) with a small host budget; all finish with exact
data, nothing is killed, and the host memory the shims hold together never passes the budget.

Measured on an H200 (140 GiB card, 128 GiB of host RAM) before the budget: three processes of 60
GiB each made host staging as large as their device memory (60 GiB registered each), and two of
them plus an eviction took the host to the kernel's OOM killer, which SIGKILLed one of them.

The stand-in counts device memory per process (not across processes, as one card would), so the
card is passed as the scheduler sees it: the shims say the card is 1 GiB, the pool is all of it
(``--reserve 0``), three processes of 400 MiB do not fit together. A stand-in with one card
shared by every process (a file the fakes account in) and a host-memory limit would let this test
also see the driver refuse the card's memory and the host run out; it needs no other change.
"""

from __future__ import annotations

import re
import time

from jupyter_gpushare.scheduler_client import SchedulerClient

MiB = 1 << 20
CARD = 1024 * MiB
CONTEXT = 32 * MiB
BIG = 400 * MiB  # three of them, with their contexts, pass the card
BUDGET = 512 * MiB  # room for one process's memory on the host, not two


def test_three_processes_past_the_card_keep_the_host_within_its_budget(harness):
    sched = harness.scheduler(
        pool="", quantum=0.5, args=("--reserve", "0", "--host-budget", f"{BUDGET // MiB}MiB")
    )
    common = {
        "context_bytes": CONTEXT,
        "idle_seconds": 0,
        "log": "info",
        "fake_device_total": CARD,
    }
    procs = [harness.spawn("hold", 2.0, BIG, 20000, **common, client_id=cid) for cid in "ABC"]
    client = SchedulerClient(str(sched.socket_path))
    peak, at_peak, samples = 0, None, 0
    while any(p.popen.poll() is None for p in procs):
        doc = client.status_sync()
        host = doc["host"]
        assert host["budget_bytes"] == BUDGET, host
        samples += 1
        if host["held_bytes"] > peak:
            peak, at_peak = host["held_bytes"], doc
        time.sleep(0.05)
    runs = [p.finish(60) for p in procs]
    for run in runs:  # nothing killed: every process exits by itself, its data exact
        assert run.returncode == 0, run.describe()
        assert run.event("hold_end")["data_ok"], run.stderr
    # They took turns: memory went to the host and came back.
    assert sched.log.count("evicted client=") >= 1, sched.log
    assert sched.log.count("restored client=") >= 1, sched.log
    # Every report the scheduler had, summed over the node at that moment, within the budget;
    # and the status agreed whenever it was sampled.
    held = [int(n) for n in re.findall(r"host client=\S+ .* node_held=(\d+)", sched.log)]
    assert held and max(held) <= BUDGET, (max(held, default=None), sched.log)
    assert samples >= 10 and 0 < peak <= BUDGET, (peak, at_peak)
