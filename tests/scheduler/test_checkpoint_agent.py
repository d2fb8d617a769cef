"""Who a checkpoint agent acts on (scheduler/checkpoint_agent.py): only its own descendants of
its own uid, so that a scheduler cannot make a user's Jupyter server freeze any other process of
hers. The end-to-end tests with real separate uids are in
tests/reliability/test_deep_idle_service_account.py."""

from __future__ import annotations

import os
import subprocess
import sys

from jupyter_gpushare.scheduler.checkpoint_agent import CheckpointAgent, ancestors


def test_an_agent_acts_on_its_descendants_only() -> None:
    agent = CheckpointAgent("/nonexistent.sock")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert os.getpid() in ancestors(child.pid)
        assert agent._may(child.pid) == ""
        # Its parent, a process of the same uid, is not its descendant: refused.
        assert "not a descendant" in agent._may(os.getppid())
        assert "not a descendant" in agent._may(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert "no process" in agent._may(child.pid)


def test_an_agent_refuses_a_process_of_another_uid() -> None:
    """Even its own child, once that runs as another user (here: nobody, 65534)."""
    agent = CheckpointAgent("/nonexistent.sock")
    if os.getuid() != 0:
        assert "is not of uid" in agent._may(1)  # init is root's
        return
    child = subprocess.Popen(["sleep", "30"], user=65534, group=65534, extra_groups=[])
    try:
        assert os.getpid() in ancestors(child.pid)
        assert "is not of uid" in agent._may(child.pid)
    finally:
        child.kill()
        child.wait()
