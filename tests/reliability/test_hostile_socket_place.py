"""Issue 22, item 1 (the scheduler's side) and item 2 (the hub's side), as real separate uids.

* The scheduler's own socket: with XDG_RUNTIME_DIR unset its directory is
  ``$TMP/gpushare-$UID``, which mallory can make first in the sticky shared directory, as a
  symlink (to a directory alice owns, to flip later; or to her own) or as her own directory. The
  scheduler opens the directory without following a link, checks it on that fd and binds and
  renames through the fd: it refuses to start with one line, and nothing of it lands in
  mallory's directory.
* The hub's side: the node scheduler runs as a service account (``gpushare`` under
  deploy/systemd); kernels trust its socket only when ``GPUSHARE_SERVICE_USER`` names it, which
  the hub's pre-spawn hook sets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 (the children cannot read the interpreter's files)
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from local_users import LocalUser, collect, kill, spawn_as, tmp_dir

from jupyter_gpushare import hub
from jupyter_gpushare.identity import generate_key
from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler, SchedulerStartError
from jupyter_gpushare.scheduler_client import SchedulerClient, SchedulerUnavailable


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A directory like /tmp (1777: everyone may create in it), short enough for sockets."""
    with tmp_dir(0o1777) as path:
        yield path


def _start_scheduler(path: str, service_user: str = "", serve: str = "") -> str:
    """A scheduler on ``path``: why it refused to start ('' if it started). With ``serve``, it
    serves until that file exists."""

    async def attempt() -> str:
        sched = GPUShareScheduler(
            use_nvml=False, recovery_seconds=0, socket_path=path, service_user=service_user
        )
        try:
            await sched.start()
        except SchedulerStartError as exc:
            return str(exc)
        while serve and not os.path.exists(serve):
            await asyncio.sleep(0.05)
        await sched.stop()
        return ""

    return asyncio.run(attempt())


def _directory_of(user: LocalUser, path: str, mode: int) -> str:
    os.mkdir(path, mode)
    os.chown(path, user.uid, user.gid)
    return path


def test_the_scheduler_never_binds_through_a_directory_it_does_not_own(
    local_users: Any, shared_tmp: str
) -> None:
    alice, mallory = local_users("alice"), local_users("mallory")
    hers = _directory_of(mallory, os.path.join(shared_tmp, "m"), 0o755)
    own = _directory_of(alice, os.path.join(shared_tmp, "a"), 0o700)
    place = os.path.join(shared_tmp, f"gpushare-{alice.uid}")
    path = os.path.join(place, "scheduler.sock")
    # A symlink of mallory's to a directory alice owns: every check of the path passes, and the
    # bind follows the link wherever it points by then (the race mallory wins by flipping it).
    for target, why in ((own, "is a link"), (hers, "is a link")):
        os.symlink(target, place)
        os.lchown(place, mallory.uid, mallory.gid)
        refused = collect(*spawn_as(alice, _start_scheduler, path), 60)
        assert why in refused and place in refused, refused
        assert "\n" not in refused, refused
        assert os.listdir(own) == [] and os.listdir(hers) == [], "the scheduler bound through it"
        os.unlink(place)
    # mallory's own directory in that place.
    os.rename(hers, place)
    refused = collect(*spawn_as(alice, _start_scheduler, path), 60)
    assert f"belongs to uid {mallory.uid}" in refused and "\n" not in refused, refused
    assert os.listdir(place) == []
    # A directory of alice's own there: it starts (the check refuses only what it must).
    os.rename(place, hers)
    os.rename(own, place)
    assert collect(*spawn_as(alice, _start_scheduler, path), 60) == ""
    assert not [n for n in os.listdir(place) if n.endswith(".sock")], "it left its socket"


def _status(path: str, environment: dict[str, str]) -> str:
    """A kernel's server with the hook's environment asks the node scheduler for its status."""
    os.environ.update(environment)
    try:
        SchedulerClient(path, timeout=10).status_sync()
    except SchedulerUnavailable as exc:
        return str(exc)
    return ""


def test_the_hubs_hook_names_the_node_schedulers_service_account(
    local_users: Any, shared_tmp: str, tmp_path: Path
) -> None:
    """The node scheduler runs as its service account (as deploy/systemd's unit does); a hub
    user's server gets the environment from hub.TokenHook and trusts that socket only because
    the hook names the account (before: it refused it, and the kernels ran unshared)."""
    service, alice = local_users("svc"), local_users("alice")
    place = _directory_of(service, os.path.join(shared_tmp, "run"), 0o755)
    path = os.path.join(place, "scheduler.sock")
    stop = os.path.join(shared_tmp, "stop")
    pid, rfd = spawn_as(service, _start_scheduler, path, service.name, stop)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert time.monotonic() < deadline, "the node scheduler did not start"
            time.sleep(0.05)
        key = tmp_path / "user.key"
        generate_key(str(key))
        spawner = SimpleNamespace(user=SimpleNamespace(name=alice.name), environment={})
        hub.TokenHook(key, socket=path, service_user=service.name)(spawner)
        assert spawner.environment["GPUSHARE_SERVICE_USER"] == service.name
        assert collect(*spawn_as(alice, _status, path, spawner.environment), 60) == ""
        # Without the name, the same socket is refused (the kernels would run unshared).
        unnamed = {k: v for k, v in spawner.environment.items() if k != "GPUSHARE_SERVICE_USER"}
        refused = collect(*spawn_as(alice, _status, path, unnamed), 60)
        assert f"belongs to uid {service.uid}" in refused, refused
    finally:
        Path(stop).touch()
        assert collect(pid, rfd, 30) == ""
        kill(pid)


def test_the_shipped_hub_config_names_the_units_account() -> None:
    """deploy/jupyterhub's config and the hook's default name the account deploy/systemd's unit
    runs the node scheduler as."""
    root = Path(__file__).resolve().parents[2]
    unit = (root / "deploy" / "systemd" / "gpushare-scheduler.service").read_text()
    user = next(ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("User="))
    assert user == hub.SYSTEM_SERVICE_USER
    shipped = (root / "deploy" / "jupyterhub" / "jupyterhub_config.py").read_text()
    assert f'service_user="{user}"' in shipped
