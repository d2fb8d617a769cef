"""A kernel provisioner that starts every kernel under the GPU-sharing shim.

:class:`GPUShareProvisioner` is jupyter_client's :class:`LocalProvisioner` plus the environment
that puts ``libgpushare.so`` in front of the CUDA driver. A kernelspec opts in through its
``kernel.json`` (``jupyter gpushare install-kernelspec`` writes such variants)::

    "metadata": {
        "kernel_provisioner": {
            "provisioner_name": "gpushare-provisioner",
            "config": {"memory_limit": "8GiB", "weight": 2}
        }
    }

or every kernel of a server uses it, whatever its kernelspec says nothing about provisioners::

    # jupyter_server_config.py
    c.KernelProvisionerFactory.default_provisioner_name = "gpushare-provisioner"
    c.GPUShareProvisioner.memory_limit = "8GiB"   # server-wide default quota per kernel

Values in ``kernel.json``'s ``config`` win over the server's configuration.

What a kernel gets (environment of the kernel process):

* ``LD_PRELOAD``: the shim, *appended* to what is already preloaded (never overwritten);
* ``GPUSHARE_SOCKET``: the scheduler's socket (:attr:`GPUShareProvisioner.socket`; the server
  extension sets ``$GPUSHARE_SOCKET`` in the server process when it embeds the scheduler);
* ``GPUSHARE_CLIENT_ID``: the kernel id, so the scheduler, the server extension and the
  ``%gpushare`` magic all name the kernel the same way;
* ``GPUSHARE_LABEL``: the notebook path (``JPY_SESSION_NAME``) when known, else the kernel's
  working directory;
* ``GPUSHARE_USER``, ``GPUSHARE_MEMORY_LIMIT`` and ``GPUSHARE_WEIGHT`` from the traits below;
* whatever else the server's environment has, ``GPUSHARE_SERVICE_USER`` included (the node
  scheduler's service account, which the shim trusts only when named: docs/protocol.md).

IPython kernels also load the ``%gpushare`` magic by themselves: the provisioner adds
``--InteractiveShellApp.extra_extensions=jupyter_gpushare.magic`` to an ipykernel's command line.
``extra_extensions`` (IPython ≥ 7.10, what ``--ext`` sets) is loaded *in addition to* the user's
own ``c.InteractiveShellApp.extensions``, so no configuration of theirs is overridden, and nothing
has to be installed in the user's IPython profile. A kernel whose Python cannot import
``jupyter_gpushare`` only logs a warning; its cells run as usual.

Several GPUs
------------
On a node with several GPUs every kernel runs on one of them. Before launching, the provisioner
asks the scheduler where the kernel goes (the ``place`` control action: the GPU with the most
free memory after what its kernels are expected to use, see
:mod:`jupyter_gpushare.scheduler.features.placement`) and starts the kernel with
``CUDA_VISIBLE_DEVICES=<that GPU's UUID>``: the kernel sees one GPU, as ``cuda:0``, and UUIDs do
not change when devices are renumbered. A kernel can be pinned to a GPU by index (nvidia-smi's)
or UUID with :attr:`GPUShareProvisioner.device` (server config, or ``"device"`` in kernel.json's
provisioner ``config``) or with ``"metadata": {"gpushare": {"device": ...}}`` in kernel.json.
A ``CUDA_VISIBLE_DEVICES`` already in the kernel's environment (the server's, or the
kernelspec's ``env``) is left alone. Without a scheduler, or with one that knows no GPU (no
NVML), the kernel starts without ``CUDA_VISIBLE_DEVICES`` (a pin is then set as given); with a
single GPU nothing is set. The chosen GPU is kept in the provisioner info (``gpushare_device``).

Shutdown and restart
--------------------
jupyter_client stops a kernel with an interrupt, a ``shutdown_request``, then SIGTERM after half
of the shutdown wait time and SIGKILL after the other half. The shim synchronises outstanding GPU
work and says GOODBYE both at a normal exit and on SIGTERM (it waits at most 5 s for the
synchronisation), so the provisioner makes sure each of the two phases lasts long enough for that:
:attr:`GPUShareProvisioner.shutdown_wait_time` is a lower bound on the manager's wait time. An
immediate kill (``shutdown_kernel(now=True)``) is preceded by a SIGTERM and a short grace period
(:attr:`GPUShareProvisioner.kill_grace_seconds`).

MPS mode
--------
When the scheduler runs in MPS mode (``c.GPUShareScheduler.mps = True``, docs/mps.md), the
provisioner asks it at launch for the kernel's MPS environment (the ``mps_env`` control action:
``CUDA_MPS_PIPE_DIRECTORY`` of the GPU's MPS daemon, the compute share from
:attr:`GPUShareProvisioner.compute_share` or the weight, the hard memory limit from the quota), so
the kernel is an MPS client from its first CUDA call. A kernel of an MPS server must not be killed
with work in flight: before any SIGKILL (``kill()``, a restart, ``shutdown_kernel(now=True)``) the
provisioner asks the scheduler to ``terminate_client`` the kernel and its subprocesses (the
``mps_terminate`` action), and only then sends the signal.

A restarted kernel keeps its kernel id. The scheduler gives a second live connection announcing
an id already in use the name ``<id>#<pid>``, which would leave the server extension's
``kernel_state`` reports pointing at nothing. Before launching, the provisioner therefore waits
(asynchronously, up to :attr:`GPUShareProvisioner.stale_client_timeout`) until the scheduler no
longer lists a client of that id, so the new process registers under the plain kernel id as a
new client, with zero usage. The old process has exited by then, so this normally takes one
status round trip.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import secrets
import signal
import sys
import time
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Bool, Float, Int, TraitError, Unicode, Union, default, validate

from .adoption import (
    AdoptedProcess,
    process_start_time,
    remove_record,
    same_process,
    write_record,
)
from .identity import ENV_TOKEN, ENV_USER
from .paths import default_socket_path
from .protocol import ErrorCode
from .scheduler.shell.devices import discover_devices_async
from .scheduler.shell.kernel_ids import ENV_KERNEL_SECRET, secret_digest
from .scheduler_client import SchedulerClient, SchedulerError, SchedulerUnavailable
from .shim import ShimNotFound, library_path, shim_environment
from .units import parse_memory_size, parse_size

__all__ = ["MAGIC_EXTENSION", "PROVISIONER_NAME", "GPUShareProvisioner", "is_ipykernel_argv"]

#: The name under which the provisioner is registered (entry point group
#: ``jupyter_client.kernel_provisioners``), as kernel.json files refer to it.
PROVISIONER_NAME = "gpushare-provisioner"

#: The IPython extension that defines ``%gpushare``.
MAGIC_EXTENSION = "jupyter_gpushare.magic"

_EXTENSION_OPTIONS = (
    "--ext",
    "--InteractiveShellApp.extra_extensions",
    "--IPKernelApp.extra_extensions",
)


def is_ipykernel_argv(argv: list[str]) -> bool:
    """Whether a kernel command line starts ipykernel (``-m ipykernel_launcher``, ``-m
    ipykernel``, or an ``ipykernel``/``ipykernel_launcher`` script)."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            module = argv[i + 1]
            return module in ("ipykernel", "ipykernel_launcher") or module.startswith("ipykernel.")
        if arg.startswith("-m") and len(arg) > 2:
            module = arg[2:]
            return module in ("ipykernel", "ipykernel_launcher") or module.startswith("ipykernel.")
    if argv:
        base = os.path.basename(argv[0])
        return base in ("ipykernel", "ipykernel_launcher")
    return False


def _inherited_quota(env: dict[str, str]) -> int:
    """An inherited GPUSHARE_MEMORY_LIMIT in bytes; 0 when unset or invalid (the shim ignores an
    invalid one with a warning, so the kernel runs without a quota)."""
    try:
        return parse_size(env.get("GPUSHARE_MEMORY_LIMIT") or 0)
    except ValueError:
        return 0


def _has_extension(argv: list[str], extension: str) -> bool:
    for i, arg in enumerate(argv):
        for option in _EXTENSION_OPTIONS:
            if arg == option and i + 1 < len(argv) and extension in argv[i + 1]:
                return True
            if arg.startswith(option + "=") and extension in arg:
                return True
    return False


def _default_user() -> str:
    hub_user = os.environ.get("GPUSHARE_USER") or os.environ.get("JUPYTERHUB_USER")
    if hub_user:
        return hub_user
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (containers)
        return str(os.getuid())


class GPUShareProvisioner(LocalProvisioner):  # type: ignore[misc]
    """Launches a local kernel under the GPU-sharing shim (``libgpushare.so``).

    Configurable from the server (``c.GPUShareProvisioner.<trait>``) and per kernelspec
    (``metadata.kernel_provisioner.config`` in kernel.json; those values win).
    """

    socket = Unicode(
        help="""The scheduler's socket. Default: $GPUSHARE_SOCKET of the server process (the
        server extension sets it when it embeds the scheduler), else the node's default
        (jupyter_gpushare.paths.default_socket_path()).""",
    ).tag(config=True)

    memory_limit = Union(
        [Int(), Unicode()],
        default_value="",
        help="""The kernel's memory quota: bytes, or a size such as "8GiB" or "512M" (all units
        are 1024-based). "" or 0: no quota (the kernel may use the whole pool).""",
    ).tag(config=True)

    weight = Float(
        1.0, help="The kernel's fair-share weight (2 = twice the GPU time of a weight-1 kernel)."
    ).tag(config=True)

    user = Unicode(
        help="""The user label shown in status. Default: $GPUSHARE_USER, else $JUPYTERHUB_USER,
        else the server's login name. Informational: the scheduler goes by the verified uid, or,
        on a shared uid, by the user that GPUSHARE_USER_TOKEN proves (a kernel whose environment
        carries a token keeps the GPUSHARE_USER it was made for, whatever this says).""",
    ).tag(config=True)

    label = Unicode(
        "",
        help="""What the scheduler shows for the kernel. Default (""): the notebook path when the
        server knows it, else the kernel's working directory.""",
    ).tag(config=True)

    load_magic = Bool(
        True,
        help="""Load the %gpushare magic into IPython kernels (adds
        --InteractiveShellApp.extra_extensions=jupyter_gpushare.magic to ipykernel's command
        line).""",
    ).tag(config=True)

    shutdown_wait_time = Float(
        12.0,
        help="""Lower bound, in seconds, of the time the kernel manager waits for a kernel to
        stop (half for the shutdown request, half after SIGTERM) before it kills it. The shim
        needs up to 5 s to synchronise outstanding GPU work and say goodbye to the scheduler.""",
    ).tag(config=True)

    kill_grace_seconds = Float(
        2.0,
        help="""When a kernel is killed outright (no shutdown request, no SIGTERM before), it
        first gets SIGTERM and this many seconds to let the shim synchronise and say goodbye.
        0: SIGKILL at once.""",
    ).tag(config=True)

    stale_client_timeout = Float(
        5.0,
        help="""Before a (re)start, wait at most this long for the scheduler to forget a previous
        client of the same kernel id, so the new process registers under the kernel id itself
        and starts with zero usage.""",
    ).tag(config=True)

    device = Unicode(
        "",
        help="""Pin kernels to one GPU: its index (as nvidia-smi numbers them) or its UUID
        ("GPU-..."). "": the scheduler places each kernel where it fits best.""",
    ).tag(config=True)

    place_kernels = Bool(
        True,
        help="""Ask the scheduler which GPU each kernel goes to and set CUDA_VISIBLE_DEVICES
        accordingly (on a node with several GPUs). False: kernels see every GPU.""",
    ).tag(config=True)

    #: Where the kernel was placed: {"device": uuid or pin, "index": ..., "source": ...}, or None.
    placement: dict[str, Any] | None = None

    mps = Bool(
        True,
        help="""When the scheduler runs in MPS mode, start the kernel as a client of its GPU's
        MPS server (and terminate_client it before any SIGKILL). False: never an MPS client.""",
    ).tag(config=True)

    compute_share = Float(
        0.0,
        help="""In MPS mode, the percentage of the GPU's SMs the kernel may use
        (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), 1-100. 0: from the weight (the scheduler's
        mps_default_thread_percentage times the weight).""",
    ).tag(config=True)

    survive_server_restart = Bool(
        False,
        help="""Let kernels outlive a crashed or restarted Jupyter server, for the next server
        on the same runtime directory to adopt (same kernel id, state and scheduler client;
        docs/reliability.md). Meant for a node scheduler. The trade-off: a kernel whose server
        died keeps its GPU memory (and its process) until a new server adopts it and it is
        shut down or culled there, or until someone ends it (`gpushare evict`, kill).""",
    ).tag(config=True)

    mps_terminate_timeout = Float(
        35.0,
        help="""Seconds to wait for the scheduler's terminate_client before a SIGKILL goes ahead
        anyway.""",
    ).tag(config=True)

    @validate("compute_share")
    def _validate_compute_share(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 <= value <= 100:
            raise TraitError(f"GPUShareProvisioner.compute_share must be 0-100, got {value!r}")
        return value

    @default("socket")
    def _socket_default(self) -> str:
        return default_socket_path()

    @default("user")
    def _user_default(self) -> str:
        return _default_user()

    @validate("memory_limit")
    def _validate_memory_limit(self, proposal: Any) -> Any:
        value = proposal["value"]
        if value in ("", 0):
            return value
        try:
            parse_memory_size(value)
        except ValueError as exc:
            raise TraitError(f"GPUShareProvisioner.memory_limit: {exc}") from None
        return value

    @validate("weight")
    def _validate_weight(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise TraitError(f"GPUShareProvisioner.weight must be positive, got {value!r}")
        return value

    # ------------------------------------------------------------------------------------------

    @property
    def quota_bytes(self) -> int:
        """The memory limit in bytes (0 = none)."""
        return 0 if self.memory_limit in ("", 0) else parse_size(self.memory_limit)

    def _label_for(self, env: dict[str, str], cwd: Any) -> str:
        if self.label:
            return self.label
        session = env.get("JPY_SESSION_NAME", "")
        if session:
            return self._session_api_path(session) or session
        return str(cwd) if cwd else os.getcwd()

    def _session_api_path(self, session: str) -> str | None:
        """The notebook path of a session (JPY_SESSION_NAME) relative to the server's root."""
        root = self._server_root_dir()
        if root and os.path.isabs(session):
            try:
                rel = os.path.relpath(session, root)
            except ValueError:
                return None
            if not rel.startswith(".."):
                return rel
        return None

    def _server_root_dir(self) -> str | None:
        # KernelManager -> MappingKernelManager (jupyter_server) has root_dir.
        km = self.parent
        mkm = getattr(km, "parent", None)
        root = getattr(mkm, "root_dir", None)
        return root if isinstance(root, str) and root else None

    def _kernel_command(self, cmd: list[str]) -> list[str]:
        if not self.load_magic or not is_ipykernel_argv(cmd):
            return cmd
        if _has_extension(cmd, MAGIC_EXTENSION):
            return cmd
        return [*cmd, f"--InteractiveShellApp.extra_extensions={MAGIC_EXTENSION}"]

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """LocalProvisioner's preparation (connection file, command, kernelspec env), then the
        shim's environment on top of the result and the magic on ipykernel's command line."""
        try:
            library = library_path()
        except ShimNotFound as exc:
            raise RuntimeError(f"cannot start a GPU-shared kernel: {exc}") from exc

        kwargs = await super().pre_launch(**kwargs)
        env: dict[str, str] = kwargs["env"]
        label = self._label_for(env, kwargs.get("cwd"))
        # A token proves one user name (the hub set both): never relabel the kernel away from
        # it, or the scheduler would refuse the kernel.
        proven = env.get("GPUSHARE_USER") if env.get("GPUSHARE_USER_TOKEN") else None
        # No quota configured: an inherited GPUSHARE_MEMORY_LIMIT (the operator's) stays.
        quota = self.quota_bytes
        kwargs["env"] = shim_environment(
            env,
            socket=self.socket,
            client_id=self.kernel_id,
            quota=quota or None,
            weight=self.weight,
            user=proven or self.user,
            label=label,
            library=library,
        )
        kwargs["cmd"] = self._kernel_command(list(kwargs["cmd"]))
        if self.survive_server_restart:
            # No parent poller: the kernel outlives its server (jupyter_client's launcher sets
            # JPY_PARENT_PID unless independent; an inherited one would arm it as well).
            kwargs["independent"] = True
            kwargs["env"].pop("JPY_PARENT_PID", None)
        self._launch_env = kwargs["env"]
        await self._mps_environment(kwargs["env"], quota or _inherited_quota(env))
        await self._wait_for_stale_client()
        await self._bind_kernel(kwargs["env"])
        await self._place(kwargs["env"])
        self._term_sent = False
        self.log.debug(
            "gpushare: kernel %s under the shim (socket %s, quota %s, weight %s, label %r)",
            self.kernel_id,
            self.socket,
            self.memory_limit or "none",
            self.weight,
            label,
        )
        return kwargs

    _launch_env: dict[str, str] | None = None

    def _scheduler(self, timeout: float) -> SchedulerClient:
        """A scheduler client that speaks for the kernel's user: with the user and token that
        the kernel itself sends in its HELLO. On a uid that many users share (JupyterHub with one
        system user, Kubernetes) the scheduler refuses a control message without them."""
        env = self._launch_env or {}
        return SchedulerClient(
            self.socket,
            timeout=timeout,
            user=env.get(ENV_USER) or None,
            token=env.get(ENV_TOKEN) or None,
        )

    # -- MPS mode ------------------------------------------------------------------------------

    _mps_device: str | None = None

    async def _mps_environment(self, env: dict[str, str], quota: int) -> None:
        """Make the kernel an MPS client when the scheduler runs in MPS mode (see module doc);
        ``quota``: the kernel's quota in bytes as launched (0: none)."""
        self._mps_device = None
        if not self.mps:
            return
        client = self._scheduler(5.0)
        try:
            reply = await client.control(
                "mps_env",
                client=self.kernel_id,
                weight=self.weight,
                quota=quota,
                compute_share=self.compute_share or None,
            )
        except SchedulerUnavailable as exc:
            self.log.debug("gpushare: no MPS environment: %s", exc)
            return
        except SchedulerError as exc:
            if exc.name == "bad_request" and "unknown action" in exc.message:
                return  # a scheduler from before MPS mode
            raise RuntimeError(f"cannot start the kernel as an MPS client: {exc}") from exc
        if not reply.get("enabled"):
            return
        for key in reply.get("unset", []):
            env.pop(key, None)
        env.update({str(k): str(v) for k, v in reply.get("env", {}).items()})
        self._mps_device = str(reply.get("device"))
        self.log.info(
            "gpushare: kernel %s is an MPS client of %s (%s)",
            self.kernel_id,
            self._mps_device,
            ", ".join(f"{k}={v}" for k, v in sorted(reply.get("env", {}).items())),
        )

    async def _mps_terminate(self) -> None:
        """Ask the scheduler to terminate_client the kernel (and its subprocesses) so that the
        SIGKILL that follows finds no work of it on the GPU. Failures are logged: the kill goes
        ahead regardless (a kernel must always be killable)."""
        assert self.process is not None
        pid = self.process.pid
        client = self._scheduler(self.mps_terminate_timeout)
        t0 = time.monotonic()
        try:
            reply = await client.control("mps_terminate", pid=pid, tree=True)
        except (SchedulerUnavailable, SchedulerError) as exc:
            self.log.warning(
                "gpushare: terminate_client for kernel %s (pid %d) failed: %s; killing it anyway",
                self.kernel_id,
                pid,
                exc,
            )
            return
        done = reply.get("terminated", [])
        log = self.log.info if reply.get("ok", False) else self.log.warning
        log(
            "gpushare: terminate_client for kernel %s (pid %d): %d client(s), %s, %.0f ms",
            self.kernel_id,
            pid,
            len(done),
            "ok" if reply.get("ok", False) else "FAILED",
            (time.monotonic() - t0) * 1000,
        )

    async def send_signal(self, signum: int) -> None:
        """In MPS mode a SIGKILL is preceded by terminate_client (see module doc)."""
        if (
            signum == getattr(signal, "SIGKILL", None)
            and self._mps_device is not None
            and self.process is not None
            and self.process.poll() is None
        ):
            await self._mps_terminate()
        await super().send_signal(signum)

    async def _wait_for_stale_client(self) -> None:
        """Wait until the scheduler lists no client named after this kernel (see module doc)."""
        if not self.kernel_id or self.stale_client_timeout <= 0:
            return
        client = self._scheduler(2.0)
        deadline = time.monotonic() + self.stale_client_timeout
        stale: dict[str, Any] | None = None
        while True:
            try:
                doc = await client.status()
            except (SchedulerUnavailable, SchedulerError) as exc:
                self.log.debug("gpushare: no stale-client check: %s", exc)
                return
            stale = _find_client(doc, self.kernel_id)
            if stale is None:
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        self.log.warning(
            "gpushare: the scheduler still lists a client %s (pid %s) after %.1f s; the restarted "
            "kernel will be registered as %s#<pid> until it leaves",
            self.kernel_id,
            stale.get("pid"),
            self.stale_client_timeout,
            self.kernel_id,
        )

    #: Seconds between two tries of a bind the scheduler was not there for: the first, then
    #: doubling up to the last (a scheduler restarting under systemd is back within seconds).
    BIND_RETRY_SECONDS = (0.25, 1.0)
    _bind_retry: asyncio.Task[None] | None = None

    async def _bind_kernel(self, env: dict[str, str]) -> None:
        """Give the kernel a secret of its own (GPUSHARE_KERNEL_SECRET: its environment is
        readable by its owner only) and bind its id to the secret's digest before it starts,
        so that no other process gets the id, even one that says HELLO with it first
        (scheduler/shell/kernel_ids.py). Without the scheduler the kernel starts all the same
        and the bind is tried again in the background until the scheduler answers (its own
        first HELLO, with the secret, binds the id too: whichever comes first)."""
        self._stop_bind_retry()
        secret = env[ENV_KERNEL_SECRET] = secrets.token_hex(32)
        if not self.kernel_id:
            return
        digest = secret_digest(secret)
        if await self._try_bind(digest) is None:
            self._bind_retry = asyncio.ensure_future(self._retry_bind(digest))

    async def _try_bind(self, digest: str) -> bool | None:
        """One ``bind_kernel``: True when bound, False when refused for good, None when the
        scheduler did not answer (try again)."""
        try:
            await self._scheduler(5.0).control(
                "bind_kernel", client=self.kernel_id, secret_sha256=digest
            )
        except SchedulerUnavailable as exc:
            self.log.debug("gpushare: kernel %s's id not bound yet: %s", self.kernel_id, exc)
            return None
        except SchedulerError as exc:
            if exc.name == "bad_request" and "unknown action" in exc.message:
                return False  # a scheduler from before kernel secrets
            self.log.warning(
                "gpushare: kernel %s's id is not bound to its secret: %s", self.kernel_id, exc
            )
            return False
        return True

    async def _retry_bind(self, digest: str) -> None:
        """Try the bind again until the scheduler answers (never blocking the server's loop);
        it stops with the kernel (:meth:`cleanup`, or the next start's :meth:`_bind_kernel`)."""
        delay, longest = self.BIND_RETRY_SECONDS
        self.log.info(
            "gpushare: the scheduler did not answer; kernel %s's id is bound when it does",
            self.kernel_id,
        )
        while True:
            await asyncio.sleep(delay)
            delay = min(longest, delay * 2)
            if self.process is not None and self.process.poll() is not None:
                return  # the kernel ended (and nobody called cleanup)
            bound = await self._try_bind(digest)
            if bound is not None:
                if bound:
                    self.log.info("gpushare: kernel %s's id is bound now", self.kernel_id)
                return

    def _stop_bind_retry(self) -> None:
        if self._bind_retry is not None:
            self._bind_retry.cancel()
            self._bind_retry = None

    def _pinned_device(self) -> str:
        """The pin from kernel.json's ``metadata.gpushare.device``, else :attr:`device`."""
        spec = getattr(self, "kernel_spec", None)
        metadata = getattr(spec, "metadata", None) or {}
        section = metadata.get("gpushare") if isinstance(metadata, dict) else None
        if isinstance(section, dict) and section.get("device") not in (None, ""):
            return str(section["device"]).strip()
        return self.device.strip()

    async def _place(self, env: dict[str, str]) -> None:
        """Choose the kernel's GPU and set CUDA_VISIBLE_DEVICES (see "Several GPUs" above)."""
        self.placement = None
        if not self.place_kernels:
            return
        if "CUDA_VISIBLE_DEVICES" in env:
            self.log.info(
                "gpushare: kernel %s keeps CUDA_VISIBLE_DEVICES=%r from its environment",
                self.kernel_id,
                env["CUDA_VISIBLE_DEVICES"],
            )
            self.placement = {"device": env["CUDA_VISIBLE_DEVICES"], "source": "environment"}
            return
        pin = self._pinned_device()
        client = self._scheduler(5.0)
        reachable = await _reachable_gpus()
        try:
            answer = await client.place(
                self.kernel_id or "", self.quota_bytes or None, pin or None, reachable
            )
        except SchedulerError as exc:
            if pin and exc.code == ErrorCode.BAD_REQUEST:
                why = exc.message
                raise RuntimeError(f"cannot start the kernel on GPU {pin!r}: {why}") from exc
            if not pin and exc.code == ErrorCode.NOT_FOUND:
                _no_gpu_once(self.log)  # in plain words, once: not per kernel with a code
                return
            self._unplaced(env, pin, exc.message)
            return
        except SchedulerUnavailable as exc:
            self._unplaced(env, pin, str(exc))
            return
        if not pin and int(answer.get("devices") or 0) <= 1:
            self.log.debug("gpushare: one GPU: kernel %s sees it as is", self.kernel_id)
            return
        env["CUDA_VISIBLE_DEVICES"] = str(answer["device"])
        self.placement = {
            "device": answer["device"],
            "index": answer.get("index"),
            "source": "pinned" if pin else "scheduler",
            "fits": answer.get("fits"),
        }
        self.log.info(
            "gpushare: kernel %s on GPU %s (%s, index %s)",
            self.kernel_id,
            answer["device"],
            answer.get("reason"),
            answer.get("index"),
        )

    def _unplaced(self, env: dict[str, str], pin: str, why: str) -> None:
        """No placement from the scheduler: a pin is applied as given, else nothing is set."""
        if not pin:
            self.log.info("gpushare: kernel %s not placed on a GPU: %s", self.kernel_id, why)
            return
        env["CUDA_VISIBLE_DEVICES"] = pin
        if pin.isdigit():
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's indexes = nvidia-smi's
        self.placement = {"device": pin, "source": "pinned"}
        self.log.warning(
            "gpushare: kernel %s pinned to GPU %s without the scheduler's placement: %s",
            self.kernel_id,
            pin,
            why,
        )

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["gpushare_device"] = self.placement
        info["gpushare_mps_device"] = self._mps_device
        info["gpushare_user"] = (self._launch_env or {}).get(ENV_USER)
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """Also takes over the kernel's running process (pid), as adoption by a new server
        does (:mod:`jupyter_gpushare.adoption`)."""
        await super().load_provisioner_info(provisioner_info)
        self.placement = provisioner_info.get("gpushare_device")
        self._mps_device = provisioner_info.get("gpushare_mps_device")
        if provisioner_info.get("gpushare_user"):
            self._launch_env = {ENV_USER: str(provisioner_info["gpushare_user"])}
        pid = provisioner_info.get("pid")
        if self.process is None and pid and same_process(pid, provisioner_info.get("start_time")):
            self.process = AdoptedProcess(int(pid), provisioner_info.get("start_time"))

    # -- surviving the server (see jupyter_gpushare.adoption) ----------------------------------

    def _runtime_dir(self) -> str:
        connection_file = getattr(self.parent, "connection_file", "") or ""
        return os.path.dirname(connection_file) if connection_file else ""

    async def post_launch(self, **kwargs: Any) -> None:
        await super().post_launch(**kwargs)
        runtime = self._runtime_dir()
        if not self.survive_server_restart or not runtime or self.pid is None or not self.kernel_id:
            return
        info = await self.get_provisioner_info()
        info.pop("connection_info", None)  # the connection file has it (with the key)
        info["start_time"] = process_start_time(self.pid)
        session = (self._launch_env or {}).get("JPY_SESSION_NAME", "")
        doc = {
            "kernel_name": getattr(self.parent, "kernel_name", ""),
            "cwd": str(kwargs.get("cwd") or ""),
            "notebook": self._session_api_path(session) if session else None,
            "provisioner_info": info,
            "start_time": info["start_time"],
        }
        try:
            await write_record(runtime, self.kernel_id, doc)
        except OSError as exc:
            self.log.warning(
                "gpushare: kernel %s will not be found again after a server restart: %s",
                self.kernel_id,
                exc,
            )

    async def cleanup(self, restart: bool = False) -> None:
        self._stop_bind_retry()
        await super().cleanup(restart=restart)
        runtime = self._runtime_dir()
        if not restart and runtime and self.kernel_id:
            await remove_record(runtime, self.kernel_id)

    # -- shutdown ------------------------------------------------------------------------------

    _term_sent = False

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return max(recommended, self.shutdown_wait_time)

    async def terminate(self, restart: bool = False) -> None:
        self._term_sent = True
        await super().terminate(restart=restart)

    async def kill(self, restart: bool = False) -> None:
        """SIGKILL, but give the shim a chance first when nobody sent SIGTERM before."""
        if (
            self.process is not None
            and not self._term_sent
            and self.kill_grace_seconds > 0
            and self.process.poll() is None
            and sys.platform != "win32"
        ):
            self._term_sent = True
            try:
                await self.send_signal(signal.SIGTERM)
            except OSError:
                pass
            else:
                deadline = time.monotonic() + self.kill_grace_seconds
                while time.monotonic() < deadline:
                    if self.process is None or self.process.poll() is not None:
                        break
                    await asyncio.sleep(0.05)
        await super().kill(restart=restart)


#: The GPUs this process can reach (see _reachable_gpus): unknown until first asked.
_UNKNOWN: Any = object()
_reachable: Any = _UNKNOWN


_said_no_gpu = False


def _no_gpu_once(log: Any) -> None:
    """The scheduler knows no GPU: say so once per server, in the words users see elsewhere."""
    global _said_no_gpu
    if _said_no_gpu:
        log.debug("gpushare: no NVIDIA GPU found: the kernel starts without a GPU placement")
        return
    _said_no_gpu = True
    log.warning(
        "gpushare: no NVIDIA GPU found (the scheduler knows none yet): kernels start without a "
        "GPU placement, and a GPU that a kernel finds is learnt from it"
    )


async def _reachable_gpus() -> list[str] | None:
    """The UUIDs of the GPUs this server (and so its kernels) can use, as NVML in this process
    sees them; None when NVML cannot tell. A node-wide scheduler sees every GPU of the node, a
    server in a container only those given to it: placement must choose among the latter.
    Asked once per process (in an executor: NVML blocks); the GPUs do not change meanwhile."""
    global _reachable
    if _reachable is _UNKNOWN:
        found = await discover_devices_async()
        _reachable = [d.uuid for d in found.devices] if found.ok and found.devices else None
    return _reachable  # type: ignore[no-any-return]


def _find_client(doc: dict[str, Any], client_id: str) -> dict[str, Any] | None:
    for device in doc.get("devices", []) or []:
        for client in device.get("clients", []) or []:
            if client.get("id") == client_id:
                return dict(client)
    return None
