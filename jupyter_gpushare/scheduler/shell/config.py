"""The scheduler's configuration: every ``c.GPUShareScheduler.*`` trait, validated, in one class.

:class:`SchedulerConfig` holds the traits and what follows from them alone (the policy's
configuration, a device's pool); :class:`~.server.GPUShareScheduler` inherits them, so operators
keep writing ``c.GPUShareScheduler.pool_size = "24GiB"``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from traitlets import Bool, Enum, Float, Int, List, TraitError, Unicode, Union, default, validate
from traitlets.config import LoggingConfigurable

from ...paths import ENV_SERVICE_USER, default_socket_path, service_uid
from ...units import format_size, parse_memory_size, parse_size
from ..core.hints import CellHints
from ..core.ordering import ORDERINGS, OrderingConfig
from ..core.policy_config import POLICIES, PolicyConfig
from ..core.room import KEEP_FREE_WAIT, KeepFree
from .host_memory import HostBudget, cgroup_limit, resolve_budget

__all__ = ["SchedulerConfig"]


class SchedulerConfig(LoggingConfigurable):
    """The scheduler's traits (docs/operators/node-scheduler.md lists them for operators)."""

    socket_path = Unicode(
        help="""Path of the scheduler's Unix socket. Default: $GPUSHARE_SOCKET, else
        /run/gpushare/scheduler.sock for root and
        ${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/scheduler.sock for everyone else (the shim
        computes the same default).""",
    ).tag(config=True)

    @default("socket_path")
    def _default_socket_path(self) -> str:
        return default_socket_path()

    socket_mode = Int(
        0o666,
        help="""Permission bits of the socket file. Connecting needs write permission; who may
        reach the socket at all is decided by its directory (0700 per user, 0755 node-wide). Use
        0o660 with socket_group to limit a node-wide scheduler to one group.""",
    ).tag(config=True)

    socket_dir_mode = Int(
        None,
        allow_none=True,
        help="""Mode of the socket's directory when the scheduler creates it. Default: 0700 for a
        per-user directory (gpushare-$UID) and 0755 otherwise (a node-wide socket that every
        user's kernels must reach). An existing directory is never chmod-ed.""",
    ).tag(config=True)

    socket_group = Unicode(
        "",
        help="Group name (or gid) that owns the socket; '' leaves the scheduler's own group.",
    ).tag(config=True)

    service_user = Unicode(
        help="""The service account a node scheduler runs as (a user name or uid), as kernels
        and the command line must be told it: they trust a socket, its directory and its
        listener only when they are the user's own, root's or this account's
        ($GPUSHARE_SERVICE_USER in their environment; docs/protocol.md, "Trusting the socket").
        Default: $GPUSHARE_SERVICE_USER. A scheduler that is neither root nor this account
        refuses to start with it set: every client would refuse it.""",
    ).tag(config=True)

    @default("service_user")
    def _default_service_user(self) -> str:
        return os.environ.get(ENV_SERVICE_USER, "")

    @validate("service_user")
    def _validate_service_user(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if not value:
            return value
        uid = service_uid({ENV_SERVICE_USER: value})
        if uid is None:
            raise TraitError(f"service_user: no user {value!r} on this machine")
        if os.getuid() not in (0, uid):
            raise TraitError(
                f"service_user: {value!r} is uid {uid} but this scheduler runs as uid "
                f"{os.getuid()}: shims and clients would refuse its socket"
            )
        return value

    pool_size = Union(
        [Int(), Unicode()],
        default_value="",
        help="""Memory pool per device that the scheduler hands out: bytes or a size such as
        '24GiB' (1024-based units). '' or 0: the device's total memory minus pool_reserve. A
        pool larger than a device is clamped to the device.""",
    ).tag(config=True)

    pool_reserve = Union(
        [Int(), Unicode()],
        default_value="1GiB",
        help="""Memory kept out of the automatic pool (pool_size = ''): what the driver keeps for
        itself and what processes outside the scheduler use (the X server, monitoring agents).
        Contexts of shimmed processes are already counted per client (context_bytes).""",
    ).tag(config=True)

    base_quantum = Float(5.0, help="Time quantum (seconds) of exclusive turns.").tag(config=True)
    move_factor = Float(
        4.0,
        help="""A turn lasts at least move_factor times the time its memory takes to move, so a
        handoff costs at most 1/move_factor of the GPU's time.""",
    ).tag(config=True)
    max_quantum = Float(60.0, help="Upper bound of a turn (seconds).").tag(config=True)
    evict_bandwidth = Float(
        10e9, help="Estimated GPU-to-host bandwidth of an eviction (bytes/second)."
    ).tag(config=True)
    restore_bandwidth = Float(
        50e9, help="Estimated host-to-GPU bandwidth of a restore (bytes/second)."
    ).tag(config=True)
    usage_half_life = Float(
        600.0, help="Half-life (seconds) of the GPU usage that fair share remembers per user."
    ).tag(config=True)

    scheduling_policy = Enum(
        list(POLICIES),
        default_value="gpushare",
        help="""The scheduling policy. "gpushare": side by side while footprints fit the pool,
        turns otherwise, a holder whose cell ended gives the device away at once.
        "fixed-quantum": a baseline for comparison, an exclusive lock held for fixed_quantum
        seconds unless a timer every idle_check_interval seconds finds the holder idle.""",
    ).tag(config=True)
    fixed_quantum = Float(30.0, help="Turn length (seconds) of the fixed-quantum policy.").tag(
        config=True
    )
    idle_check_interval = Float(
        5.0, help="Seconds between the fixed-quantum policy's checks for an idle holder."
    ).tag(config=True)
    precopy_idle = Bool(
        True,
        help="""Ask an idle kernel whose memory is on the GPU to copy it to host memory in the
        background (PRECOPY) while it stays there, so that evicting it for the next arrival is
        an unmap of milliseconds instead of a copy of seconds. Costs host memory (the shim's
        GPUSHARE_HOST_BUDGET bounds the fast part) and PCIe bandwidth while nobody waits.""",
    ).tag(config=True)
    keep_free = Union(
        [Int(), Unicode()],
        default_value="auto",
        help="""Memory to keep free on each device for the next kernel to arrive: a size (bytes or
        '8GiB'), "auto" (the largest of the last 8 arrivals' memory on that device, at most a
        quarter of its pool; nothing before the first arrival), or 0 (off). While nobody waits
        and less than this is free, idle kernels whose memory is already copied to the host
        (precopy_idle) are evicted, least recently used first: an unmap, made before the arrival
        instead of in its wait. A kernel that comes back after such an eviction is held idle
        60 s (doubling with each return) before the next. Needs precopy_idle.""",
    ).tag(config=True)
    host_budget = Union(
        [Int(), Unicode()],
        default_value="auto",
        help="""Host memory the shims' staging and evicted memory may take on this node, all
        kernels together: a size (bytes or '100GiB'), "auto" (the node's MemAvailable at the
        scheduler's start, or its cgroup's memory limit when lower, less host_reserve), or 0
        (not accounted: each shim bounds only its own registered staging, GPUSHARE_HOST_BUDGET).
        No eviction that would pass it is decided: the kernel that needs the room waits and its
        cell says why, and one whose memory is more than the GPU's pool and this budget together
        is told it can never fit. Staging is shared out within it, idle kernels first
        (docs/architecture.md, "Host memory is a budget").""",
    ).tag(config=True)
    host_reserve = Union(
        [Int(), Unicode()],
        default_value="auto",
        help="""With host_budget "auto": the host memory left out of the budget for what grows
        after the start and is nobody's staging (the kernels' own memory, page cache, new
        kernels). "auto": max(4 GiB, 20% of the RAM). 10% was too little: on an H200 node
        (128 GiB of RAM) three 60 GiB PyTorch processes with the budget full left 4.5 GiB
        available (docs/gpu-verification.md, 2026-12-02): each CUDA process holds gigabytes
        of host memory of its own.""",
    ).tag(config=True)
    short_first = Bool(
        True,
        help="""Under memory pressure, a notebook's cell still on the interactive ordering's first
        level (less than ordering_first_level GPU-seconds) queues ahead of waiters that waited
        long, and may have a longer busy cell's missing memory moved out before that cell's
        quantum ends, when the move costs less than the cell is expected to run on
        (docs/architecture.md, "Short cells first"). Off: short cells wait for the quantum.""",
    ).tag(config=True)
    room_updates = Bool(
        True,
        help="""Tell a kernel that holds the GPU when the room its grant gave it changes (the
        kernels beside it started or ended a cell, or their memory grew or left), so that memory
        it allocates past the room is left unbacked and the kernel waits for room, instead of
        being backed beside the others and then evicted (docs/architecture.md, "Room in grants").
        Off: a grant's room stays what it was at the grant.""",
    ).tag(config=True)
    restore_ahead = Bool(
        False,
        help="""Move a kernel's evicted memory back to the GPU before its turn (RESTORE_AHEAD), into
        room nobody else is owed: a waiter at or near the head of the line, a kernel Jupyter says
        has a cell coming (kernel_state busy or coming), or, while nobody waits, a kernel idle
        for at most 10 minutes. Never evicts anyone for it, never into keep_free's room; the
        memory comes back with a current host copy, so taking it back is an unmap
        (docs/architecture.md, "Restore ahead"). Off by default: the simulator found no room to
        use on the notebook-shaped trace (docs/performance.md, section 8).""",
    ).tag(config=True)
    overload_long_cap = Int(
        0,
        help="""Under overload (the working sets of the kernels that want a GPU exceed its pool), at
        most this many long cells (past the ordering's first level) hold memory at once; another
        long cell takes the place of one that has held overload_window seconds, and nothing else
        is evicted for it. Short cells are not capped. 0 (the default): no cap. Off by default:
        a capped long cell waits up to overload_window for its turn, which a short run (the
        stand-in replay) does not outlast; the simulator's rows have it on (docs/architecture.md,
        "No thrashing").""",
    ).tag(config=True)
    overload_window = Float(
        120.0,
        help="""Seconds a capped long cell holds memory before another long cell may take its place,
        and the starvation window while the GPU is overloaded (see overload_long_cap).""",
    ).tag(config=True)
    cell_hints = Bool(
        True,
        help="""Act on a notebook's hint that a cell is coming (kernel_state coming: a cell queued
        behind another, an execute request while the kernel is paused, a code cell of a kernel
        whose memory is away focused or edited in JupyterLab): restore that kernel's evicted
        memory ahead of its cell, unmapping idle kernels whose memory has a complete host copy
        for its room (never busy ones, never while anyone waits). Per user, at most 3 hints at
        once and one more every 10 s; a wrong hint costs the bytes it moved
        (docs/architecture.md, "Cell hints"). Off: a hint acts only as restore_ahead allows.""",
    ).tag(config=True)
    keep_free_wait = Float(
        KEEP_FREE_WAIT,
        help="""With keep_free "auto": keep room ahead only while making it on demand would keep
        the next arrival waiting at least this many seconds (the room's bytes at the unmap time
        the shims' evictions of pre-copied memory measured). Room made ahead costs each kernel
        evicted for it a restore if it comes back first, about thirty times an unmap per byte on
        an H100: in the simulator, keeping it regardless raised nbmix's p95 slowdown at 8 users
        from 3.18x to 3.62x. 0: always keep it (the behaviour before). A keep_free size is kept
        as set.""",
    ).tag(config=True)
    deep_idle_seconds = Float(
        600.0,
        help="""Seconds a kernel must stay idle before it gives back everything, its CUDA context
        included (deep idle): its memory is evicted, then the scheduler checkpoints the process
        with the driver (cuCheckpointProcessLock/Checkpoint, CUDA 12.8+) and restores it at its
        next GPU call or when its notebook turns busy. 0 turns it off. Needs the scheduler to run
        as root or as the kernel's user; a driver without the API turns it off (logged once).""",
    ).tag(config=True)
    checkpoint_library = Unicode(
        "libcuda.so.1",
        help="""The CUDA driver library the scheduler calls the process checkpoint API in (deep
        idle). Tests point it at the stand-in driver.""",
    ).tag(config=True)
    checkpoint_lock_timeout = Float(
        10.0,
        help="""Seconds cuCheckpointProcessLock may wait for a kernel's CUDA work to finish
        before the sleep is given up (the kernel stays awake).""",
    ).tag(config=True)

    # The interactive-first ordering (docs/architecture.md, "The ordering: shorter cells first").
    ordering = Enum(
        list(ORDERINGS),
        default_value="interactive",
        help="""Among busy kernels that all fit: "interactive", the cell with the least GPU time
        so far goes first and longer ones pause at their gate (memory kept); "fair", every
        kernel that fits runs side by side.""",
    ).tag(config=True)
    ordering_first_level = Float(
        1.0, help="GPU seconds (per unit of weight) a cell has before newer cells go first."
    ).tag(config=True)
    ordering_level_ratio = Float(
        4.0, help="Each further level of the interactive ordering holds this many times more."
    ).tag(config=True)
    ordering_min_slice = Float(
        0.1, help="Seconds a kernel holds the GPU before the ordering may pause it."
    ).tag(config=True)
    ordering_starvation_window = Float(
        20.0,
        help="""Seconds a busy kernel may stay paused at a stretch (then it runs its share);
        at least twice ordering_min_slice.""",
    ).tag(config=True)

    admin_uids = List(
        Int(),
        help="""Uids that may act on any client (release, evict, set_quota, kernel_state), in
        addition to root and the scheduler's own uid. Everyone else may act on their own
        clients only (the uid comes from SO_PEERCRED).""",
    ).tag(config=True)

    users_config = Unicode(
        "",
        help="""Path of the operator's users config (TOML): per-user and per-group memory quota
        ceilings and fair-share weights, defaults for everyone else, admins by user, group or
        uid. '' = none (no ceilings; weights as the kernels ask). See
        docs/operators/node-scheduler.md. Re-read on SIGHUP.""",
    ).tag(config=True)

    user_key_file = Unicode(
        "",
        help="""Path of the node's user key (create it with `gpushare keygen PATH`; mode 0600).
        Peers of token_uids prove their user with a token derived from it
        (jupyter_gpushare.identity). Re-read on SIGHUP.""",
    ).tag(config=True)

    token_uids = List(
        Union([Int(), Unicode()]),
        help="""Uids (or user names) that many users share: a JupyterHub spawning single-user
        servers under its own uid, the uid of Kubernetes user pods (1000, jovyan). A peer of
        one of them must send a user and a valid token (GPUSHARE_USER, GPUSHARE_USER_TOKEN),
        or it is refused; its identity is that user. Such a peer is never an admin by its uid,
        only by its user name or groups. Needs user_key_file.""",
    ).tag(config=True)

    allocation_dir = Unicode(
        "",
        help="""Where the per-allocation sockets of the Kubernetes device plugin go, one
        directory each (scheduler/features/allocations.py). Default: 'alloc' beside the socket.""",
    ).tag(config=True)

    state_dir = Unicode(
        "",
        help="""The scheduler's private state (mode 0700): the device plugin's allocations and
        their ceilings, so that a restart keeps them. Default: 'state' beside the socket. Put it
        on persistent storage (the Helm chart: /var/lib/gpushare) to keep them over a reboot.""",
    ).tag(config=True)

    metrics_port = Int(
        0,
        min=0,
        max=65535,
        help="""Serve Prometheus metrics over HTTP on this port (0 = off). The listener runs in
        its own thread; the metrics are taken from the event loop's decisions and snapshots.""",
    ).tag(config=True)

    metrics_address = Unicode(
        "127.0.0.1",
        help="""Address the metrics listener binds to. The metrics include per-user GPU time
        and memory: keep it on localhost or a management network.""",
    ).tag(config=True)

    metrics_interval = Float(
        1.0, help="Seconds between two refreshes of the metrics' gauges (holders, queues, memory)."
    ).tag(config=True)

    metrics_in_process = Bool(
        False,
        help="""Keep the metrics even without metrics_port, for the process that runs this
        scheduler to serve (the Jupyter server's /metrics serves an embedded scheduler's).""",
    ).tag(config=True)

    use_nvml = Bool(
        True,
        help="""Discover devices with NVML at start. When off, or when NVML is missing, devices
        are learnt from the shims' HELLO messages.""",
    ).tag(config=True)

    utilization_interval = Float(
        1.0,
        help="""Seconds between two readings of each GPU's utilisation (shown in the status for
        people to read; scheduling never depends on it) and of each process's memory through
        NVML (a client counts as using at least what NVML sees its process hold:
        docs/reliability.md, "A hostile local user"). 0 turns the readings off.""",
    ).tag(config=True)
    unmanaged_memory = Enum(
        ["count", "warn", "ignore"],
        default_value="count",
        help="""GPU processes NVML lists that never registered with the scheduler (no shim: a
        program run outside Jupyter, or one that bypasses the shim). "count": their memory is
        taken off the device's pool while NVML sees it, and each is logged once; "warn": only
        logged (a warning); "ignore": neither. Each device's status shows their bytes as
        ``unmanaged_bytes`` whatever the choice. Needs NVML readings (utilization_interval).""",
    ).tag(config=True)

    placement_estimate = Union(
        [Int(), Unicode()],
        default_value="1GiB",
        help="""Memory a kernel without a quota is expected to use, when the scheduler places a
        new kernel on a GPU (the ``place`` control action; a kernel with a quota is expected to
        use its quota). Bytes or a size such as '4GiB'.""",
    ).tag(config=True)

    placement_timeout = Float(
        120.0,
        help="""Seconds a placement reserves room on its GPU while the kernel has not connected
        (a kernel connects when it first uses CUDA). Reservations make kernels started at the
        same moment spread over the GPUs instead of all choosing the emptiest one.""",
    ).tag(config=True)

    mps = Bool(
        False,
        help="""MPS mode: run one NVIDIA MPS control daemon per GPU and make every kernel the
        provisioner starts a client of its GPU's MPS server, so kernels admitted side by side
        run concurrently, each with a compute share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and a
        hard memory limit (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) from its weight and quota. See
        docs/mps.md.""",
    ).tag(config=True)

    mps_control_binary = Unicode(
        "",
        help="""The nvidia-cuda-mps-control to run. Default: the one on PATH, else
        /usr/local/nvidia/bin or /usr/bin.""",
    ).tag(config=True)

    mps_devices = List(
        Unicode(),
        help="""GPUs (UUIDs or indices, as CUDA_VISIBLE_DEVICES takes them) that get an MPS
        daemon. Default: every GPU NVML discovers.""",
    ).tag(config=True)

    mps_default_thread_percentage = Float(
        100.0,
        help="""Compute share (percent of the SMs) of a weight-1 kernel in MPS mode; a kernel
        gets this times its weight (at most 100), unless its provisioner sets compute_share.
        Below 100 it is also the daemon's default (set_default_active_thread_percentage).""",
    ).tag(config=True)

    mps_runtime_dir = Unicode(
        "",
        help="""Where each MPS daemon's pipe and log directories go (mps-<n>/pipe, mps-<n>/log).
        Default: the socket's directory.""",
    ).tag(config=True)

    mps_terminate_timeout = Float(
        30.0, help="Seconds a terminate_client may take before it counts as failed."
    ).tag(config=True)

    @validate("mps_default_thread_percentage")
    def _validate_mps_percentage(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 < value <= 100:
            raise ValueError(f"mps_default_thread_percentage must be in (0, 100], got {value!r}")
        return value

    recovery_seconds = Float(
        3.0,
        help="""When the last scheduler on this socket left clients behind (it crashed: its
        socket is still there; or it stopped with clients connected: it left <socket>.clients),
        how long to hold back grants so that those clients can reconnect and say what they held
        (shims retry within 2.5 s). Only in this window are such claims believed. 0 turns the
        window off. See docs/reliability.md.""",
    ).tag(config=True)

    max_connections_per_uid = Int(
        256,
        help="""Connections one uid may hold open at once (every kernel, and each of its
        subprocesses that use CUDA, holds one; so do control requests while they run). A uid
        past it is refused with an error, so one user cannot take every descriptor and lock out
        the others. Root and the scheduler's own uid are not limited. 0 = no limit.""",
    ).tag(config=True)

    handshake_seconds = Float(
        10.0,
        help="""Seconds a new connection has to send its first whole message (HELLO, or a
        control request); one that does not is closed, so half-sent frames cannot pile up.""",
    ).tag(config=True)

    revoke_deadline_seconds = Float(
        120.0,
        help="""Seconds a holder has to answer a revoke. Past it the scheduler stops waiting
        (docs/reliability.md): it counts the holder as released with its memory still on the
        GPU, so waiters that fit beside it run; in MPS mode it has the holder's processes
        terminate_client'ed; with revoke_signal set it signals the holder's process
        revoke_signal_grace seconds later if it still has not answered. 0 = wait forever.""",
    ).tag(config=True)

    revoke_signal = Unicode(
        "",
        help="""Signal for a holder still silent revoke_signal_grace seconds after its revoke
        deadline (e.g. 'SIGINT' interrupts a notebook cell, 'SIGKILL' ends the kernel); '' sends
        none. Only a scheduler that may signal the process (root, or its owner) can.""",
    ).tag(config=True)

    revoke_signal_grace = Float(
        30.0, help="Seconds after the revoke deadline before revoke_signal is sent."
    ).tag(config=True)

    @validate("revoke_signal")
    def _validate_signal(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if value and not hasattr(signal, value.upper()):
            raise TraitError(f"revoke_signal: {value!r} is not a signal name (e.g. 'SIGINT')")
        return value.upper()

    revoke_warning_seconds = Float(
        60.0,
        help="""Log a warning when a holder has not answered a revoke for this long (its GPU work
        still runs while others wait; docs/reliability.md). 0 turns the warning off.""",
    ).tag(config=True)

    @validate(
        "base_quantum",
        "move_factor",
        "max_quantum",
        "evict_bandwidth",
        "restore_bandwidth",
        "ordering_first_level",
        "ordering_starvation_window",
    )
    def _validate_positive(self, proposal: Any) -> Any:
        value = proposal["value"]
        if not value > 0 or value == float("inf"):
            raise TraitError(f"{proposal['trait'].name} must be a positive number, not {value!r}")
        return value

    @validate(
        "usage_half_life",
        "utilization_interval",
        "recovery_seconds",
        "revoke_warning_seconds",
        "handshake_seconds",
        "revoke_deadline_seconds",
        "revoke_signal_grace",
        "ordering_min_slice",
    )
    def _validate_non_negative(self, proposal: Any) -> Any:
        value = proposal["value"]
        if not value >= 0 or value == float("inf"):
            raise TraitError(f"{proposal['trait'].name} must be 0 or more, not {value!r}")
        return value

    @validate("ordering_level_ratio")
    def _validate_ratio(self, proposal: Any) -> Any:
        value = proposal["value"]
        if not 1 < value < float("inf"):
            raise TraitError(f"ordering_level_ratio must be above 1, not {value!r}")
        return value

    @validate("admin_uids")
    def _validate_uids(self, proposal: Any) -> Any:
        bad = [uid for uid in proposal["value"] if uid < 0]
        if bad:
            raise TraitError(f"admin_uids: {bad[0]} is not a uid")
        return proposal["value"]

    @validate("socket_mode", "socket_dir_mode")
    def _validate_mode(self, proposal: Any) -> Any:
        value = proposal["value"]
        name = proposal["trait"].name
        if value is not None and not 0 <= value <= 0o777:
            raise TraitError(f"{name} must be permission bits (0 to 0o777)")
        if name == "socket_dir_mode" and value is not None and value & 0o022:
            # Shims and the CLI refuse a socket in a directory others may write (they could swap
            # the socket): such a mode would lock every client out.
            raise TraitError(f"{name} must not let the group or others write (got {value:#o})")
        return value

    @validate("pool_size", "pool_reserve", "placement_estimate")
    def _validate_size(self, proposal: Any) -> Any:
        value = proposal["value"]
        if value != "":
            try:
                parse_size(value)
            except ValueError as exc:
                raise ValueError(f"{proposal['trait'].name}: {exc}") from None
            if isinstance(value, str) and "." in value and value.strip()[-1:].isdigit():
                # '--pool 0.5' is half a byte, surely meant as a fraction or in GiB: say so.
                raise ValueError(
                    f"{proposal['trait'].name}: {value!r} is a fraction of a byte: give a unit, "
                    f"e.g. '{value.strip()}GiB'"
                )
            try:
                parse_memory_size(value)  # '--pool 24' is 24 bytes: surely 24GiB was meant
            except ValueError as exc:
                raise ValueError(f"{proposal['trait'].name}: {exc}") from None
        return value

    @validate("host_budget", "host_reserve")
    def _validate_host_size(self, proposal: Any) -> Any:
        return _size_or_auto(proposal["value"], proposal["trait"].name, "(or 'auto')")

    def _host_budget(self) -> HostBudget:
        """The host budget as the traits and the node say at the start (reads /proc and the
        cgroup), said once in the log."""
        budget = resolve_budget(self.host_budget, self.host_reserve, limit=cgroup_limit())
        self.log.info("gpushare: host memory budget %s", budget.how)
        return budget

    @validate("keep_free")
    def _validate_keep_free(self, proposal: Any) -> Any:
        return _size_or_auto(proposal["value"], "keep_free", "(or 'auto', or 0: off)")

    def keep_free_config(self) -> KeepFree:
        if self.keep_free == "auto":
            return KeepFree(auto=True, min_wait=max(0.0, self.keep_free_wait))
        return KeepFree(size=parse_size(self.keep_free))

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            base_quantum=self.base_quantum,
            move_factor=self.move_factor,
            # A base quantum above the bound raises the bound (said once at start, in start()).
            max_quantum=max(self.max_quantum, self.base_quantum),
            evict_bandwidth=self.evict_bandwidth,
            restore_bandwidth=self.restore_bandwidth,
            usage_half_life=self.usage_half_life,
            policy=self.scheduling_policy,
            fixed_quantum=self.fixed_quantum,
            idle_check_interval=self.idle_check_interval,
            precopy_idle=self.precopy_idle,
            keep_free=self.keep_free_config(),
            short_first=self.short_first,
            restore_ahead=self.restore_ahead,
            cell_hints=CellHints(on=self.cell_hints),
            overload_long_cap=max(0, self.overload_long_cap),
            overload_window=max(0.0, self.overload_window),
            room_updates=self.room_updates,
            host_budget=self._host_budget().budget,
            ordering=OrderingConfig(
                mode=self.ordering,
                first_level=self.ordering_first_level,
                level_ratio=self.ordering_level_ratio,
                min_slice=self.ordering_min_slice,
                # A window no longer than the minimum slice would pause and resume at once.
                starvation_window=max(self.ordering_starvation_window, 2 * self.ordering_min_slice),
            ),
        )

    def pool_for(self, total_bytes: int) -> int:
        """The pool of a device of ``total_bytes`` under the configured pool_size/pool_reserve."""
        size = parse_size(self.pool_size) if self.pool_size != "" else 0
        if size:
            if total_bytes and size > total_bytes:
                self.log.warning(
                    "pool_size %s is larger than the device (%s): using the whole device",
                    format_size(size),
                    format_size(total_bytes),
                )
                return total_bytes
            return size
        reserve = parse_size(self.pool_reserve) if self.pool_reserve != "" else 0
        return max(total_bytes - reserve, 0)


def _size_or_auto(value: Any, name: str, choices: str) -> Any:
    """A trait that takes a size or "auto": ``value`` as it is, or a ValueError naming it."""
    if value == "auto":
        return value
    try:
        parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc} {choices}") from None
    return value
