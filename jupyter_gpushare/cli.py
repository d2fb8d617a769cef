"""The ``gpushare`` command line: ``scheduler``, ``run`` and ``status``.

    gpushare scheduler [--socket PATH] [--pool 24GiB] [--quantum 5] [--log-level DEBUG]
                       [--users-config users.toml] [--metrics-port 9464] [--log-format json]
    gpushare run [--socket PATH] [--memory-limit 8GiB] [--weight 2] -- python train.py
    gpushare status [--socket PATH] [--json] [--watch [--interval 2]]
    gpushare release|evict CLIENT [--socket PATH] [--json]
    gpushare keygen PATH [--force] [--token-for USER]
    gpushare lab [JUPYTER LAB OPTIONS ...]

Configuration follows Jupyter's conventions: ``gpushare_config.py`` (and ``jupyter_config.py``) in
the Jupyter config path (``jupyter --paths``), or ``--config FILE``; the command line wins, e.g.
``c.GPUShareScheduler.pool_size = "24GiB"``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import sys
from copy import deepcopy
from typing import Any

from traitlets import Bool, Enum, Float, TraitError, Unicode
from traitlets.config import Application

from ._version import __version__
from .cli_words import UsageError, check_argv, in_user_words
from .paths import default_socket_path
from .scheduler.features.sleeping import EVICT_REPLY_SECONDS
from .scheduler.shell.server import GPUShareScheduler, SchedulerConfigError, SchedulerStartError
from .scheduler_client import (
    REQUEST_SECONDS,
    SchedulerClient,
    SchedulerError,
    SchedulerUnavailable,
)
from .sd_notify import sd_notify
from .status_text import format_status
from .units import parse_memory_size

__all__ = [
    "GPUShareApp",
    "KeygenApp",
    "RunApp",
    "SchedulerApp",
    "StatusApp",
    "format_status",
    "main",
]


class GPUShareBaseApp(Application):
    """Shared behaviour: version, log format, config files."""

    version = __version__

    config_file = Unicode(
        "", help="A config file to load (after gpushare_config.py in the Jupyter config path)."
    ).tag(config=True)

    aliases: dict[Any, Any] = {
        "log-level": "Application.log_level",
        "config": "GPUShareBaseApp.config_file",
    }
    #: How many words that are not options the command takes (a path, a client id); more are
    #: refused rather than ignored.
    positional = 0

    @property
    def command_name(self) -> str:
        return self.name.replace("-", " ", 1)

    def parse_command_line(self, argv: Any = None) -> None:
        args = list(sys.argv[1:] if argv is None else argv)
        if not args[:1] or args[0] not in self.subcommands:  # a subcommand checks its own
            try:
                argv = check_argv(
                    args, self.aliases, self.flags, self.positional, self.command_name
                )
            except UsageError as exc:
                print(exc, file=sys.stderr)
                self.exit(2)
        super().parse_command_line(argv)

    def _load_config(self, cfg: Any, section_names: Any = None, traits: Any = None) -> None:
        """A bad value for the application's own traits (``--log-format yaml``) is a
        configuration error like any other: one line naming the flag, exit 2."""
        try:
            super()._load_config(cfg, section_names=section_names, traits=traits)
        except TraitError as exc:
            self.config_error(exc)

    def config_error(self, exc: BaseException) -> None:
        """Stop with one line that names the flag or the config file's setting at fault."""
        self.log.critical("invalid configuration: %s", self.in_user_words(exc))
        self.exit(2)

    def in_user_words(self, exc: BaseException) -> str:
        return in_user_words(" ".join(str(exc).split()), self.aliases, self.cli_config)

    def _log_format_default(self) -> str:
        return "[%(levelname)1.1s %(asctime)s.%(msecs)03d %(name)s] %(message)s"

    def _log_datefmt_default(self) -> str:
        return "%H:%M:%S"

    def load_gpushare_config(self) -> None:
        """Load config files; what the command line set keeps priority."""
        cl_config = deepcopy(self.config)
        try:
            from jupyter_core.paths import jupyter_config_path

            paths = jupyter_config_path()
        except Exception:  # pragma: no cover - jupyter_core is a dependency
            paths = []
        # A config file that does not load stops the command with one line (exit 2): starting
        # with the defaults instead would drop an operator's quotas without a word.
        self.raise_config_file_errors = True
        for name in ("jupyter_config", "gpushare_config"):
            try:
                self.load_config_file(name, path=paths)
            except Exception as exc:
                self._bad_config(f"{name} (in {', '.join(paths)})", exc)
        if self.config_file:
            directory, filename = os.path.split(os.path.abspath(self.config_file))
            if not os.path.isfile(self.config_file):
                self.log.critical("config file not found: %s", self.config_file)
                self.exit(2)
            try:
                self.load_config_file(filename, path=directory)
            except Exception as exc:
                self._bad_config(self.config_file, exc)
        self.update_config(cl_config)

    def _bad_config(self, where: str, exc: BaseException) -> None:
        self.log.critical("invalid configuration: cannot load %s: %s", where, _one_line(exc))
        self.exit(2)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class SchedulerApp(GPUShareBaseApp):
    name = "gpushare-scheduler"
    description = """Run the node's GPU scheduler in the foreground (logs go to stderr).
    SIGTERM or Ctrl-C stops it and removes its socket; SIGHUP re-reads the users config and the
    user key (a bad new file is logged and the old one kept)."""
    examples = """gpushare scheduler --pool 24GiB --quantum 5 --log-level DEBUG
gpushare scheduler --socket /run/gpushare/scheduler.sock --users-config /etc/gpushare/users.toml \\
    --user-key /etc/gpushare/user.key --metrics-port 9464 --log-format json"""

    log_style = Enum(
        ["text", "json"],
        "text",
        help="""Log lines as text, or as one JSON object per line (ts, level, logger, message,
        event and the event's key=value fields) for a log collector.""",
    ).tag(config=True)

    aliases: dict[Any, Any] = {
        **GPUShareBaseApp.aliases,
        "socket": "GPUShareScheduler.socket_path",
        "pool": "GPUShareScheduler.pool_size",
        "reserve": "GPUShareScheduler.pool_reserve",
        "quantum": "GPUShareScheduler.base_quantum",
        "max-quantum": "GPUShareScheduler.max_quantum",
        "users-config": "GPUShareScheduler.users_config",
        "user-key": "GPUShareScheduler.user_key_file",
        "socket-group": "GPUShareScheduler.socket_group",
        "metrics-port": "GPUShareScheduler.metrics_port",
        "metrics-address": "GPUShareScheduler.metrics_address",
        "log-format": "SchedulerApp.log_style",
        "policy": "GPUShareScheduler.scheduling_policy",
        "deep-idle": "GPUShareScheduler.deep_idle_seconds",
        "keep-free": "GPUShareScheduler.keep_free",
        "host-budget": "GPUShareScheduler.host_budget",
    }
    flags: dict[Any, Any] = {
        "no-nvml": (
            {"GPUShareScheduler": {"use_nvml": False}},
            "Do not ask NVML for devices; learn them from the shims.",
        ),
        "debug": ({"Application": {"log_level": "DEBUG"}}, "Log at DEBUG level."),
        "mps": (
            {"GPUShareScheduler": {"mps": True}},
            "MPS mode: an MPS control daemon per GPU; kernels become its clients (docs/mps.md).",
        ),
    }

    classes = [GPUShareScheduler]

    def _log_level_default(self) -> int:
        return logging.INFO  # grants, revokes, evictions and restores are logged at INFO

    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        self.load_gpushare_config()
        if self.log_style == "json":
            from .scheduler.shell.logs import JsonFormatter

            for handler in self.log.handlers:
                handler.setFormatter(JsonFormatter())

    def start(self) -> None:
        try:
            scheduler = GPUShareScheduler(parent=self)
        except Exception as exc:  # a bad config value
            self.config_error(exc)
        try:
            asyncio.run(self._serve(scheduler))
        except SchedulerConfigError as exc:
            self.config_error(exc)
        except SchedulerStartError as exc:
            self.log.critical("%s", exc)
            self.exit(1)
        except OSError as exc:
            self.log.critical("cannot start the scheduler: %s", exc)
            self.exit(1)

    async def _serve(self, scheduler: Any) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, scheduler, sig)
        await scheduler.start()
        # systemd's Type=notify (deploy/systemd): units ordered after us start once the socket is.
        sd_notify(f"READY=1\nSTATUS=listening on {scheduler.socket_path}")
        try:
            await scheduler.run_forever()
        finally:
            sd_notify("STOPPING=1")

    def _on_signal(self, scheduler: Any, sig: signal.Signals) -> None:
        if sig == signal.SIGHUP:
            self.log.info("SIGHUP: reloading the users config and the user key")
            scheduler.request_reload()
            return
        self.log.info("%s: stopping", signal.Signals(sig).name)
        scheduler.request_stop()


class RunApp(GPUShareBaseApp):
    name = "gpushare-run"
    description = """Run a command under the shim: its GPU work is scheduled by the node's
    scheduler. Put the command after `--`."""
    examples = "gpushare run --memory-limit 8GiB -- python train.py --epochs 3"

    socket = Unicode("", help="The scheduler's socket (default: as the shim computes it).").tag(
        config=True
    )
    memory_limit = Unicode("", help="Memory quota, e.g. 8GiB ('' = none).").tag(config=True)
    weight = Float(0.0, help="Fair-share weight (0 = the default, 1).").tag(config=True)
    client_id = Unicode("", help="Client id (default: pid-<pid>).").tag(config=True)
    label = Unicode("", help="What runs, as status shows it (default: the command line).").tag(
        config=True
    )

    aliases: dict[Any, Any] = {
        **GPUShareBaseApp.aliases,
        "socket": "RunApp.socket",
        "memory-limit": "RunApp.memory_limit",
        "weight": "RunApp.weight",
        "client-id": "RunApp.client_id",
        "label": "RunApp.label",
    }

    command: list[str]

    def initialize(self, argv: Any = None) -> None:
        argv = list(sys.argv[1:] if argv is None else argv)
        options, command = _split_command(argv, self.aliases)
        self.command = command
        # A trailing `--` lets the check say where a stray word stands (`run GB -- cmd`).
        super().initialize([*options, "--"] if "--" in argv else options)
        self.load_gpushare_config()

    def start(self) -> None:
        from .shim import ShimNotFound, shim_environment

        if not self.command:
            print(
                "gpushare run: no command given; "
                "usage: gpushare run [OPTIONS] -- COMMAND [ARGS...]",
                file=sys.stderr,
            )
            self.exit(2)
        try:
            quota = parse_memory_size(self.memory_limit) if self.memory_limit else None
        except ValueError as exc:
            print(f"gpushare run: --memory-limit: {exc}", file=sys.stderr)
            self.exit(2)
        if self.weight < 0:
            print("gpushare run: --weight must be positive", file=sys.stderr)
            self.exit(2)
        try:
            env = shim_environment(
                os.environ,
                socket=scheduler_socket(self.socket),
                client_id=self.client_id or None,
                quota=quota,
                weight=self.weight or None,
                label=self.label or shlex.join(self.command),
            )
        except ShimNotFound as exc:
            print(f"gpushare run: {exc}", file=sys.stderr)
            self.exit(1)
        missing = no_gpu_reason()
        if missing:
            print(
                f"gpushare run: {NO_GPU} ({missing}): the command runs without one", file=sys.stderr
            )
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvpe(self.command[0], self.command, env)
        except FileNotFoundError:
            print(f"gpushare run: command not found: {self.command[0]}", file=sys.stderr)
            self.exit(127)
        except PermissionError:
            print(f"gpushare run: permission denied: {self.command[0]}", file=sys.stderr)
            self.exit(126)
        except OSError as exc:
            print(f"gpushare run: cannot run {self.command[0]}: {exc}", file=sys.stderr)
            self.exit(126)


#: The words every user-facing part uses when there is no GPU (the magic and the sidebar too).
NO_GPU = "no NVIDIA GPU found"


def no_gpu_reason() -> str | None:
    """Why this machine has no usable NVIDIA GPU, or None when the driver reports one.

    Asks the driver itself (libcuda's cuInit and cuDeviceGetCount) in this process, which exec
    replaces right after: the command's own driver state starts fresh."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "the NVIDIA driver's libcuda.so.1 is not installed"
    rc = driver.cuInit(0)
    if rc == 100:  # CUDA_ERROR_NO_DEVICE
        return "the NVIDIA driver sees no device"
    if rc != 0:
        return f"the NVIDIA driver did not start (cuInit returned {rc})"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "the NVIDIA driver sees no device"
    return None


def _split_command(argv: list[str], aliases: dict[Any, Any]) -> tuple[list[str], list[str]]:
    """Split ``gpushare run`` arguments into its own options and the command to run.

    Everything after the first ``--`` is the command. Without ``--``, the command starts at the
    first argument that is neither an option nor the value of an option that takes one.
    """
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    takes_value = {f"--{name}" for name in aliases if isinstance(name, str)}
    takes_value |= {f"-{name}" for name in aliases if isinstance(name, str) and len(name) == 1}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        if "=" not in arg and arg in takes_value:
            i += 1
        i += 1
    return argv, []


class StatusApp(GPUShareBaseApp):
    name = "gpushare-status"
    description = """Show what the node's GPU scheduler is doing: devices, pool, who holds the
    device, who waits, and each client's memory and GPU time. Exit code 1 when no scheduler is
    running."""
    examples = "gpushare status --json"

    socket = Unicode("", help="The scheduler's socket (default: as the shim computes it).").tag(
        config=True
    )
    json = Bool(False, help="Print the status document as JSON.").tag(config=True)
    device = Unicode("", help="Only this device (UUID).").tag(config=True)
    watch = Bool(False, help="Redraw the status every --interval seconds until Ctrl-C.").tag(
        config=True
    )
    interval = Float(2.0, help="Seconds between two redraws of --watch.").tag(config=True)

    aliases: dict[Any, Any] = {
        **GPUShareBaseApp.aliases,
        "socket": "StatusApp.socket",
        "device": "StatusApp.device",
        "interval": "StatusApp.interval",
    }
    flags: dict[Any, Any] = {
        "json": ({"StatusApp": {"json": True}}, "Print the status document as JSON."),
        "watch": (
            {"StatusApp": {"watch": True}},
            "Redraw the status every --interval seconds (2 by default) until Ctrl-C.",
        ),
    }

    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        self.load_gpushare_config()

    def start(self) -> None:
        if self.watch:
            self._watch()
            return
        print(self._render(self._ask()))

    def _ask(self) -> Any:
        return _ask_scheduler(
            self, "status", self.socket, lambda client: client.status_sync(self.device or None)
        )

    def _render(self, doc: Any) -> str:
        return json.dumps(doc, indent=2) if self.json else format_status(doc)

    def _watch(self) -> None:
        """Like watch(1): clear the terminal, draw, sleep; a scheduler that goes away is said
        on the screen and retried, Ctrl-C ends it (exit 0)."""
        import time

        if self.interval <= 0:
            print("gpushare status: --interval must be positive", file=sys.stderr)
            self.exit(2)
        clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
        try:
            while True:
                try:
                    body = self._render(
                        SchedulerClient(scheduler_socket(self.socket)).status_sync(
                            self.device or None
                        )
                    )
                except (SchedulerUnavailable, SchedulerError) as exc:
                    body = f"gpushare status: {exc} (retrying)"
                stamp = time.strftime("%H:%M:%S")
                print(
                    f"{clear}Every {self.interval:g} s, {stamp} (Ctrl-C ends)\n\n{body}", flush=True
                )
                time.sleep(self.interval)
        except KeyboardInterrupt:
            print()


def scheduler_socket(explicit: str) -> str | None:
    """The socket to use: ``--socket``; else, when ``$GPUSHARE_SOCKET`` is unset and nothing
    listens on the default socket, the newest of this user's JupyterLab servers' embedded
    schedulers (their runtime files, :mod:`jupyter_gpushare.lab_runtime`); else the default."""
    if explicit:
        return explicit
    if os.environ.get("GPUSHARE_SOCKET") or os.path.exists(default_socket_path()):
        return None
    from .lab_runtime import find_lab_schedulers

    labs = find_lab_schedulers()
    return str(labs[0]["socket"]) if labs else None


def _ask_scheduler(
    app: Application, command: str, socket: str, call: Any, timeout: float = REQUEST_SECONDS
) -> Any:
    """``call(client)`` on the scheduler (``timeout``: seconds for each of connecting and the
    answer); a missing or refusing scheduler exits with 1."""
    try:
        return call(SchedulerClient(scheduler_socket(socket), timeout=timeout))
    except SchedulerUnavailable as exc:
        print(f"gpushare {command}: {exc}", file=sys.stderr)
        app.exit(1)
    except SchedulerError as exc:
        print(f"gpushare {command}: the scheduler refused: {exc}", file=sys.stderr)
        app.exit(1)


class KeygenApp(GPUShareBaseApp):
    name = "gpushare-keygen"
    description = """Create the node's user key (the scheduler's user_key_file): 32 random bytes,
    hex, mode 0600. With --token-for USER, print USER's token under an existing key instead (what
    the hub puts in GPUSHARE_USER_TOKEN)."""
    examples = """gpushare keygen /etc/gpushare/user.key
gpushare keygen /etc/gpushare/user.key --token-for alice"""

    force = Bool(
        False, help="Replace an existing key (every token made with it stops working)."
    ).tag(config=True)
    token_for = Unicode("", help="Print this user's token under the key at PATH.").tag(config=True)

    aliases: dict[Any, Any] = {"token-for": "KeygenApp.token_for"}
    positional = 1  # PATH
    flags: dict[Any, Any] = {
        "force": ({"KeygenApp": {"force": True}}, "Replace an existing key."),
    }

    def start(self) -> None:
        from .identity import KeyFileError, generate_key, load_key, user_token

        if len(self.extra_args) != 1:
            print("gpushare keygen: usage: gpushare keygen PATH [--force]", file=sys.stderr)
            self.exit(2)
        path = self.extra_args[0]
        if self.token_for:
            try:
                print(user_token(load_key(path), self.token_for))
            except KeyFileError as exc:
                print(f"gpushare keygen: {exc}", file=sys.stderr)
                self.exit(1)
            return
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            print(
                f"gpushare keygen: cannot write {path}: the directory {directory} does not exist "
                f"(create it first: install -d -m 0755 {directory})",
                file=sys.stderr,
            )
            self.exit(1)
        try:
            generate_key(path, force=self.force)
        except (FileExistsError, OSError) as exc:
            print(f"gpushare keygen: {exc}", file=sys.stderr)
            self.exit(1)
        print(f"gpushare keygen: wrote a new key to {path} (mode 0600)")


class ControlApp(GPUShareBaseApp):
    """``gpushare release CLIENT`` and ``gpushare evict CLIENT``: the operator's levers."""

    action = "release"
    socket = Unicode("", help="The scheduler's socket (default: as the shim computes it).").tag(
        config=True
    )
    json = Bool(False, help="Print the scheduler's reply as JSON.").tag(config=True)
    aliases: dict[Any, Any] = {**GPUShareBaseApp.aliases, "socket": "ControlApp.socket"}
    positional = 1  # CLIENT
    flags: dict[Any, Any] = {
        "json": ({"ControlApp": {"json": True}}, "Print the scheduler's reply as JSON."),
    }

    #: What the scheduler now does, per action (the reply only says it took the request).
    DONE = {
        "release": "asked {client} to give the GPU back: its running GPU work finishes first, "
        "and its next GPU call waits for a turn",
        "evict": "asked {client} to give the GPU back and move its memory to host memory: its "
        "next GPU call waits for a turn and restores it",
    }

    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        self.load_gpushare_config()

    def start(self) -> None:
        if len(self.extra_args) != 1:
            print(f"gpushare {self.action}: one client id is needed", file=sys.stderr)
            self.exit(2)
        target = self.extra_args[0]
        reply = _ask_scheduler(
            self,
            self.action,
            self.socket,
            lambda c: c.control_sync(self.action, client=target),
            timeout=EVICT_REPLY_SECONDS if self.action == "evict" else REQUEST_SECONDS,
        )
        if self.json:
            print(json.dumps(reply))
        elif reply.get("checkpointed"):  # a holder that ignored its revoke (docs/reliability.md)
            print(f"gpushare {self.action}: {target}: {reply.get('effect')}")
        else:
            print(f"gpushare {self.action}: " + self.DONE[self.action].format(client=target))


class ReleaseApp(ControlApp):
    name = "gpushare-release"
    description = """Take the GPU back from a client (its running GPU work finishes first)."""
    examples = "gpushare release 6f1c2a0e-..."
    action = "release"


class EvictApp(ControlApp):
    name = "gpushare-evict"
    description = """Take the GPU back from a client and move its memory to the host."""
    examples = "gpushare evict 6f1c2a0e-..."
    action = "evict"


def _summary(description: str) -> str:
    """A description's first sentence, for the list of subcommands (not its first line)."""
    text = " ".join(description.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


class LabApp(GPUShareBaseApp):
    name = "gpushare-lab"
    description = """Start JupyterLab with gpushare (its scheduler embedded), as root or as a
    user, with or without a display. Options pass to `jupyter lab`."""
    examples = "gpushare lab --port 8889"

    def start(self) -> None:  # pragma: no cover - main() hands `lab` over before parsing
        from .launch import main as launch

        launch(self.extra_args)


class GPUShareApp(GPUShareBaseApp):
    name = "gpushare"
    description = """Share one GPU among many Jupyter kernels: side by side when they fit, in
    turns when they don't."""
    examples = """gpushare scheduler --pool 24GiB
gpushare run -- python train.py
gpushare status"""
    positional = 1  # a command that is not one: start() says which are

    subcommands: dict[str, Any] = {
        "scheduler": (SchedulerApp, _summary(SchedulerApp.description)),
        "run": (RunApp, _summary(RunApp.description)),
        "status": (StatusApp, _summary(StatusApp.description)),
        "keygen": (KeygenApp, _summary(KeygenApp.description)),
        "release": (ReleaseApp, _summary(ReleaseApp.description)),
        "evict": (EvictApp, _summary(EvictApp.description)),
        "lab": (LabApp, _summary(LabApp.description)),
        # Imported when chosen: its gRPC needs the k8s extra (grpcio, protobuf).
        "device-plugin": (
            "jupyter_gpushare.deviceplugin.app.DevicePluginApp",
            "GPU memory as the Kubernetes resource gpushare.io/gpu-memory (device plugin).",
        ),
    }

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        names = ", ".join(self.subcommands)
        if self.extra_args:
            print(
                f"gpushare: unknown command {self.extra_args[0]!r}; the commands are {names} "
                "(`gpushare --help` says what each does)",
                file=sys.stderr,
            )
        else:
            print(f"gpushare: a command is needed, one of {names}\n", file=sys.stderr)
            self.print_subcommands()
        self.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["lab"] and not {"-h", "--help", "--help-all"} & set(args[1:2]):
        from .launch import main as launch

        launch(args[1:])  # jupyter lab's options are its own: no parsing here
        return
    try:
        GPUShareApp.launch_instance(argv=argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
    except BrokenPipeError:
        # `gpushare status --json | head -1`: the reader has what it wanted. Python's own
        # advice: point stdout at /dev/null so that its last flush finds nothing to complain
        # about, and end as quietly as a program killed by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)


if __name__ == "__main__":  # pragma: no cover
    main()
