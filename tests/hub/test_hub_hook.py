"""jupyter_gpushare.hub without a hub: the pre-spawn hook, configure() on a traitlets Config, the
key's errors, and what a single-user server then does with the environment it gets."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets.config import Config

from jupyter_gpushare import hub
from jupyter_gpushare.identity import generate_key, load_key, user_token, verify_token
from jupyter_gpushare.serverextension.app import GPUShareExtension
from jupyter_gpushare.serverextension.backend import SchedulerBackend


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "user.key"
    generate_key(str(path))
    return path


def spawner(name: str, environment: dict[str, str] | None = None) -> Any:
    return SimpleNamespace(user=SimpleNamespace(name=name), environment=environment or {})


def test_hook_sets_the_user_its_token_and_the_node_scheduler(key_file: Path) -> None:
    hook = hub.TokenHook(key_file)
    configured = {"LANG": "C.UTF-8"}
    s = spawner("alice", configured)
    hook(s)
    env = s.environment
    assert env["GPUSHARE_USER"] == "alice"
    assert verify_token(load_key(str(key_file)), "alice", env["GPUSHARE_USER_TOKEN"])
    assert env["GPUSHARE_SCHEDULER"] == "node"
    assert env["GPUSHARE_SOCKET"] == "/run/gpushare/scheduler.sock"
    assert env["LANG"] == "C.UTF-8"
    assert configured == {"LANG": "C.UTF-8"}, "the configured dict (shared) was changed"
    assert str(key_file.read_text().strip()) not in "".join(env.values()), "the key leaked"


def test_configured_environment_wins_except_for_the_identity(key_file: Path) -> None:
    hook = hub.TokenHook(
        key_file, socket="/srv/gpushare.sock", environment={"GPUSHARE_LOG": "info"}
    )
    s = spawner(
        "bob",
        {"GPUSHARE_SOCKET": "/elsewhere.sock", "GPUSHARE_USER": "mallory", "GPUSHARE_LOG": "warn"},
    )
    hook(s)
    assert s.environment["GPUSHARE_SOCKET"] == "/elsewhere.sock"
    assert s.environment["GPUSHARE_LOG"] == "warn"
    # The hub's word for the user is not a default: it always replaces what was configured.
    assert s.environment["GPUSHARE_USER"] == "bob"
    assert s.environment["GPUSHARE_USER_TOKEN"] == user_token(load_key(str(key_file)), "bob")


def test_configure_installs_the_hook_and_chains_the_previous_one(key_file: Path) -> None:
    calls: list[str] = []
    c = Config()
    c.Spawner.pre_spawn_hook = lambda s: calls.append(s.user.name)
    hook = hub.configure(c, key_file=key_file)
    assert c.Spawner.pre_spawn_hook is hook
    again = hub.configure(c, key_file=key_file)  # twice: no double chaining
    s = spawner("carol")
    again(s)
    assert calls == ["carol"]
    assert s.environment["GPUSHARE_USER"] == "carol"


def test_key_from_a_value_as_a_kubernetes_secret_gives_it(key_file: Path) -> None:
    text = key_file.read_text()
    hook = hub.TokenHook(key=text)
    s = spawner("dave")
    hook(s)
    assert s.environment["GPUSHARE_USER_TOKEN"] == user_token(load_key(str(key_file)), "dave")
    with pytest.raises(hub.UserKeyError, match="at least 16 are needed"):
        hub.TokenHook(key="abcd")


def test_unusable_key_files_stop_the_hub_with_the_reason(tmp_path: Path, key_file: Path) -> None:
    with pytest.raises(hub.UserKeyError, match=r"does not exist.*gpushare keygen"):
        hub.TokenHook(tmp_path / "missing.key")
    os.chmod(key_file, 0o644)
    with pytest.raises(hub.UserKeyError, match="readable by its owner only"):
        hub.configure(Config(), key_file=key_file)


def test_key_file_default_from_the_hub_environment(
    key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(hub.KEY_FILE_ENV, str(key_file))
    assert hub.TokenHook().key_file == str(key_file)
    monkeypatch.delenv(hub.KEY_FILE_ENV)
    assert hub.DEFAULT_KEY_FILE == "/etc/gpushare/user.key"


def test_server_side_uses_what_the_hub_set(key_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the single-user server: the extension picks the node scheduler, and its control
    connection speaks for the hub user with the token."""
    s = spawner("erin", {"GPUSHARE_SOCKET": "/tmp/x.sock"})
    hub.TokenHook(key_file)(s)
    for name in ("GPUSHARE_USER", "GPUSHARE_USER_TOKEN", "GPUSHARE_SCHEDULER", "JUPYTERHUB_USER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s.environment.items():
        monkeypatch.setenv(name, value)
    assert GPUShareExtension().scheduler == "node"
    client = SchedulerBackend("node", "/tmp/x.sock").client
    assert (client.user, client.token) == ("erin", s.environment["GPUSHARE_USER_TOKEN"])
    # Without GPUSHARE_USER, the hub's JUPYTERHUB_USER is who the server speaks for.
    monkeypatch.delenv("GPUSHARE_USER")
    monkeypatch.setenv("JUPYTERHUB_USER", "erin")
    assert hub.server_user() == "erin"


def test_a_bad_scheduler_mode_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_SCHEDULER", "nodes")
    with pytest.raises(ValueError, match=r"\$GPUSHARE_SCHEDULER.*'nodes'"):
        _ = GPUShareExtension().scheduler
    monkeypatch.delenv("GPUSHARE_SCHEDULER")
    assert GPUShareExtension().scheduler == "embedded"


def test_the_operators_guide_shows_the_shipped_config() -> None:
    """docs/operators/jupyterhub.md shows deploy/jupyterhub/jupyterhub_config.py verbatim (the
    file the end-to-end test runs a real hub with), so the guide cannot drift from it."""
    root = Path(__file__).resolve().parents[2]
    shipped = (root / "deploy" / "jupyterhub" / "jupyterhub_config.py").read_text()
    guide = (root / "docs" / "operators" / "jupyterhub.md").read_text()
    section = guide.split("## jupyterhub_config.py", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == shipped
