"""The server extension's evict (``POST gpushare/api/kernels/{id}/evict``) waits for the
scheduler's answer as long as ``gpushare evict`` does: the answer comes after the holder's
checkpoint, which copies its device memory to the host (seconds per tens of GiB), and with the
10 s of every other request the REST call failed while the checkpoint went on."""

from __future__ import annotations

import time
from pathlib import Path

from jupyter_gpushare.serverextension.backend import SchedulerBackend
from tests.scheduler.sched_helpers import late_evict_answer


async def test_the_server_extensions_evict_waits_for_a_checkpoint_longer_than_10_s(
    tmp_path: Path,
) -> None:
    sock = tmp_path / "s.sock"
    effect = "its process was checkpointed by root: 768.00 MiB left the GPU without its help"
    body = {"ok": True, "action": "evict", "client": "A", "done": True, "effect": effect}
    backend = SchedulerBackend("node", str(sock))
    try:
        with late_evict_answer(sock, 11.0, body) as asked:
            started = time.monotonic()
            reply = await backend.control("evict", client="A")
            waited = time.monotonic() - started
    finally:
        await backend.stop()
    assert reply["effect"] == effect, reply
    assert waited >= 11.0, waited
    assert len(asked) == 1, asked
    # Any other request keeps the short wait.
    assert backend.client.timeout == 10.0
