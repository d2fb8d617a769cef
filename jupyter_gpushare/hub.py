"""JupyterHub side of jupyter-gpushare: every single-user server gets the hub's word for its user.

Many hub users can share one uid (``SimpleLocalProcessSpawner``, DockerSpawner, every pod of
Zero to JupyterHub runs as uid 1000), so the node scheduler cannot tell them apart by
``SO_PEERCRED``. The hub knows who each server belongs to: at spawn it puts

* ``GPUSHARE_USER``: the hub user's name, and
* ``GPUSHARE_USER_TOKEN``: an HMAC of that name under the node's user key
  (:func:`jupyter_gpushare.identity.user_token`)

into the server's environment. Kernels inherit both, so their shims present them in ``HELLO``, and
the server extension presents them on its control connection. A scheduler whose ``token_uids``
include the peer's uid verifies the token with the same key and then knows the user by name.

In ``jupyterhub_config.py`` (deploy/jupyterhub/jupyterhub_config.py is a complete example)::

    import jupyter_gpushare.hub
    jupyter_gpushare.hub.configure(c, key_file="/etc/gpushare/user.key")

or, to install the hook alone::

    c.Spawner.pre_spawn_hook = jupyter_gpushare.hub.TokenHook("/etc/gpushare/user.key")

The key is read once, when the hook is made (so a hub with an unreadable key fails at start, with
the path and the reason, not at the first spawn). The hub needs the key; user servers never see it,
only their own user's token.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .identity import ENV_USER, MIN_KEY_BYTES, load_key, user_environment
from .paths import ENV_SERVICE_USER, SYSTEM_SOCKET

#: The account deploy/systemd's unit runs the node scheduler as (its ``User=``).
SYSTEM_SERVICE_USER = "gpushare"

__all__ = [
    "DEFAULT_KEY_FILE",
    "KEY_FILE_ENV",
    "SCHEDULER_ENV",
    "TokenHook",
    "UserKeyError",
    "configure",
    "parse_key",
    "server_user",
]

#: Where ``configure`` looks for the node's user key unless told otherwise.
DEFAULT_KEY_FILE = "/etc/gpushare/user.key"
#: Environment variable that overrides :data:`DEFAULT_KEY_FILE` (the hub's own environment).
KEY_FILE_ENV = "GPUSHARE_USER_KEY_FILE"
#: Picks the server extension's scheduler mode (GPUShareExtension.scheduler's default).
SCHEDULER_ENV = "GPUSHARE_SCHEDULER"


def server_user(environ: Mapping[str, str] | None = None) -> str | None:
    """The user this Jupyter server (and its kernels) speaks for to the scheduler:
    ``$GPUSHARE_USER`` (the name the hub's token is for), else ``$JUPYTERHUB_USER``, else None.

    The scheduler trusts the name only with a valid token from a ``token_uids`` peer; for any
    other peer it goes by the uid (docs/protocol.md, "Transport and identity")."""
    env = os.environ if environ is None else environ
    return env.get(ENV_USER) or env.get("JUPYTERHUB_USER") or None


class UserKeyError(SystemExit):
    """The node's user key cannot be read: the hub must not start handing out servers.

    A SystemExit whose code is the message: raised while JupyterHub loads its config file, it
    ends the hub with that one line on stderr and exit code 1, where any other exception is
    printed with a traceback of JupyterHub's and traitlets' own frames."""

    def __str__(self) -> str:
        return str(self.code)


def _key_file(key_file: str | os.PathLike[str] | None) -> str:
    if key_file is not None:
        return os.fspath(key_file)
    return os.environ.get(KEY_FILE_ENV) or DEFAULT_KEY_FILE


def _read_key(path: str) -> bytes:
    try:
        return load_key(path)
    except (OSError, ValueError) as exc:
        raise UserKeyError(
            f"jupyter-gpushare: the hub cannot use the node's user key: {exc}. It needs "
            "the same key as the node scheduler (c.GPUShareScheduler.user_key_file)."
        ) from exc


def parse_key(value: str | bytes) -> bytes:
    """A key given as a value (hex text, as ``gpushare keygen`` writes it, or raw bytes), e.g.
    from a Kubernetes Secret in the hub's environment; checked as :func:`load_key` checks a file."""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    try:
        key = bytes.fromhex(raw.strip().decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = raw
    if len(key) < MIN_KEY_BYTES:
        raise UserKeyError(
            f"jupyter-gpushare: the node's user key given to the hub holds {len(key)} bytes; at "
            f"least {MIN_KEY_BYTES} are needed (make one with `gpushare keygen PATH`)"
        )
    return key


class TokenHook:
    """A ``Spawner.pre_spawn_hook`` that names the server's hub user to the node scheduler.

    At each spawn it sets, in ``spawner.environment``:

    * ``GPUSHARE_USER`` and ``GPUSHARE_USER_TOKEN`` (always: the hub's word for the user);
    * ``GPUSHARE_SCHEDULER=node`` (the server extension connects to the node scheduler instead of
      embedding one), ``GPUSHARE_SOCKET=socket``, ``GPUSHARE_SERVICE_USER=service_user`` (the
      account the node scheduler runs as: ``gpushare`` under deploy/systemd; without it the
      kernels refuse that account's socket and run unshared; ``""`` leaves it unset, for a
      scheduler running as root) and ``environment``, unless the spawner's configured
      environment already sets them.

    Setting them at spawn time, not in ``c.Spawner.environment``, keeps them whatever a
    spawner-specific config does (``c.KubeSpawner.environment`` replaces ``c.Spawner``'s).

    The key: ``key`` (hex text or bytes, e.g. from a Kubernetes Secret in the hub's environment),
    else the file ``key_file`` (default: ``$GPUSHARE_USER_KEY_FILE``, else
    ``/etc/gpushare/user.key``), read once, here. ``then``: another pre-spawn hook to run
    afterwards (``configure`` chains the one already configured).
    """

    def __init__(
        self,
        key_file: str | os.PathLike[str] | None = None,
        *,
        key: str | bytes | None = None,
        socket: str = SYSTEM_SOCKET,
        service_user: str = SYSTEM_SERVICE_USER,
        environment: Mapping[str, str] | None = None,
        then: Callable[[Any], Any] | None = None,
    ) -> None:
        if key is not None:
            self.key_file = None
            self._key = parse_key(key)
        else:
            self.key_file = _key_file(key_file)
            self._key = _read_key(self.key_file)
        service = {ENV_SERVICE_USER: service_user} if service_user else {}
        self.defaults = {
            SCHEDULER_ENV: "node",
            "GPUSHARE_SOCKET": socket,
            **service,
            **(environment or {}),
        }
        self.then = then

    def __call__(self, spawner: Any) -> Any:
        name = str(spawner.user.name)
        # A new dict: the trait's value may be the config's own dict, shared by every spawner.
        spawner.environment = {
            **self.defaults,
            **spawner.environment,
            **user_environment(self._key, name),
        }
        if self.then is not None:
            return self.then(spawner)
        return None

    def __repr__(self) -> str:
        return f"TokenHook({self.key_file or '<key>'!r})"


def configure(
    c: Any,
    *,
    key_file: str | os.PathLike[str] | None = None,
    key: str | bytes | None = None,
    socket: str = SYSTEM_SOCKET,
    service_user: str = SYSTEM_SERVICE_USER,
    environment: Mapping[str, str] | None = None,
) -> TokenHook:
    """Set up a hub's config ``c`` for a node-wide gpushare scheduler: ``c.Spawner.pre_spawn_hook``
    becomes a :class:`TokenHook` (see there for the arguments), chained before a hook already
    configured there. Returns the hook; raises :class:`UserKeyError` when the key is unusable."""
    spawner_config = c.Spawner
    previous = spawner_config.get("pre_spawn_hook") if "pre_spawn_hook" in spawner_config else None
    if isinstance(previous, TokenHook):
        previous = previous.then
    hook = TokenHook(
        key_file,
        key=key,
        socket=socket,
        service_user=service_user,
        environment=environment,
        then=previous,
    )
    spawner_config.pre_spawn_hook = hook
    return hook
