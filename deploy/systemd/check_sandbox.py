#!/usr/bin/env python3
"""Does gpushare-scheduler.service's sandbox let the scheduler reach the GPU? Run on a GPU machine:

    python3 deploy/systemd/check_sandbox.py

Needs python3 (standard library and ctypes), the NVIDIA driver, and nothing else: not the package.
Where systemd runs (PID 1, systemd-run installed) the checks run under ``systemd-run`` with the
unit's own sandbox properties; elsewhere (a container) this script applies the equivalent itself:
the unit's system-call filter as a seccomp filter (x86_64, from the groups recorded in
sandbox-syscalls.json), no new privileges, no capabilities, and an unprivileged uid (``--uid``,
default 65534 when run as root); the device cgroup, which needs systemd, is checked instead: every
device node the checks opened must be one the unit's ``DeviceAllow`` grants on this machine
(its /proc/devices). The checks, each printed with what it saw:

1. NVML: ``nvmlInit`` and every GPU's name and memory (what the scheduler does at start);
2. ``cuInit`` (deep idle's checkpoint calls load the driver library in the scheduler);
3. the driver's process checkpoint of a small CUDA program of the same uid: lock, checkpoint (its
   GPU memory must go), restore, unlock, and its data compared afterwards;
4. the device nodes opened, against the unit's device rules.

Exit status 0 when every check passed. The same rules serve tests/deploy/test_systemd.py, which
checks the unit against the device numbers and system calls the driver is known to use.

``--bisect`` (root): which part of the sandbox stops the checkpoint (uid, capabilities, no new
privileges, the filter), then which system calls or capabilities let it through, in short child
processes planned by sandbox_bisect.py; one JSON result (``verdict``, ``probes``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
UNIT = HERE / "gpushare-scheduler.service"
SYSCALLS = HERE / "sandbox-syscalls.json"
if str(HERE) not in sys.path:  # python3 -I leaves the script's folder out
    sys.path.insert(0, str(HERE))
from sandbox_bisect import capability_numbers  # noqa: E402  (beside this script)

# ------------------------------------------------------------------------------------------------
# The unit's sandbox, as systemd reads it


def unit_service(path: Path = UNIT) -> dict[str, list[str]]:
    """The unit's [Service] section: every value of a repeated key kept, in order."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@dataclass(frozen=True)
class DeviceRule:
    kind: str  # "c" or "b"
    major: int
    minor: int | None  # None: every minor
    access: str


#: What DevicePolicy=closed lets through besides DeviceAllow (systemd.resource-control(5)).
CLOSED_POLICY_DEVICES = {"/dev/null": (1, 3), "/dev/zero": (1, 5), "/dev/full": (1, 7),
                         "/dev/random": (1, 8), "/dev/urandom": (1, 9), "/dev/tty": (5, 0),
                         "/dev/ptmx": (5, 2)}  # fmt: skip


def char_groups(proc_devices: str) -> list[tuple[int, str]]:
    """(major, name) of the character device groups /proc/devices lists."""
    out, in_char = [], False
    for line in proc_devices.splitlines():
        if line.strip().endswith(":"):
            in_char = line.startswith("Character")
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[0].isdigit():
            out.append((int(fields[0]), fields[1]))
    return out


def device_rules(
    service: dict[str, list[str]], proc_devices: str, nodes: dict[str, tuple[str, int, int]]
) -> list[DeviceRule]:
    """The device cgroup systemd builds for the unit: ``char-NAME`` entries matched (as fnmatch
    patterns) against /proc/devices' character groups, paths looked up in ``nodes`` (path ->
    (kind, major, minor); a path missing there is skipped, as systemd skips a missing node)."""
    rules = []
    if service.get("DevicePolicy", ["auto"])[-1] in ("closed", "strict"):
        for major, minor in CLOSED_POLICY_DEVICES.values():
            rules.append(DeviceRule("c", major, minor, "rwm"))
        rules += [DeviceRule("c", major, None, "rw") for major, name in
                  char_groups(proc_devices) if name == "pts"]  # fmt: skip
    for entry in service.get("DeviceAllow", []):
        spec, _, access = entry.partition(" ")
        access = access.strip() or "rwm"
        if spec.startswith("char-"):
            rules += [DeviceRule("c", major, None, access) for major, name in
                      char_groups(proc_devices) if fnmatch.fnmatchcase(name, spec[5:])]  # fmt: skip
        elif spec in nodes:
            kind, major, minor = nodes[spec]
            rules.append(DeviceRule(kind, major, minor, access))
    return rules


def device_allowed(rules: list[DeviceRule], kind: str, major: int, minor: int, access: str) -> bool:
    return any(
        r.kind == kind and r.major == major and r.minor in (None, minor)
        and set(access) <= set(r.access)
        for r in rules
    )  # fmt: skip


def node_of(path: str) -> tuple[str, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        return None
    kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
    return kind, os.major(st.st_rdev), os.minor(st.st_rdev)


def syscall_groups() -> dict[str, list[str]]:
    return dict(json.loads(SYSCALLS.read_text())["groups"])


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            out |= expand(groups[name], groups)
        else:
            out.add(name)
    return out


def allowed_syscalls(service: dict[str, list[str]], groups: dict[str, list[str]]) -> set[str]:
    """The system calls the unit's SystemCallFilter= lines allow (systemd.exec(5): the first line
    sets an allow list, later lines add to it, and lines starting with ~ take away)."""
    allowed: set[str] = set()
    for line in service.get("SystemCallFilter", []):
        deny = line.startswith("~")
        names = line.lstrip("~").split()
        if deny:
            allowed -= expand(names, groups)
        else:
            allowed |= expand(names, groups)
    return allowed


# ------------------------------------------------------------------------------------------------
# The same sandbox applied in-process, where systemd cannot apply it

AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_CAPBSET_DROP = 38, 22, 2, 24


def seccomp_program(allowed_numbers: set[int], errno: int) -> list[tuple[int, int, int, int]]:
    """Classic BPF: a call of another architecture, an x32 call or a number not in
    ``allowed_numbers`` returns -``errno``; the rest run."""
    deny = (0x06, 0, 0, SECCOMP_RET_ERRNO | errno)
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, AUDIT_ARCH_X86_64), deny,  # arch
            (0x20, 0, 0, 0), (0x35, 0, 1, 0x40000000), deny]  # nr; x32  # fmt: skip
    for nr in sorted(allowed_numbers):
        prog += [(0x15, 0, 1, nr), (0x06, 0, 0, SECCOMP_RET_ALLOW)]
    return [*prog, deny]


def become(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


PR_SET_DUMPABLE, PR_SET_KEEPCAPS = 4, 8


def set_capabilities(libc: ctypes.CDLL, keep: set[int] | None, drop: set[int]) -> None:
    """Effective and permitted: what is permitted now, cut to ``keep`` (None: all) less
    ``drop``; nothing inheritable. capset(v3) takes two 32-bit words per set."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()  # (effective, permitted, inheritable) x 2 words
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    permitted = data[1] | data[4] << 32
    wanted = permitted if keep is None else permitted & sum(1 << c for c in keep)
    wanted &= ~sum(1 << c for c in drop)
    lo, hi = wanted & 0xFFFFFFFF, wanted >> 32
    data[0], data[1], data[2], data[3], data[4], data[5] = lo, lo, 0, hi, hi, 0
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def install_filter(libc: ctypes.CDLL, numbers: set[int], err: int) -> None:
    prog = seccomp_program(numbers, err)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                    ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]  # fmt: skip

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*i) for i in prog])
    fprog = SockFprog(len(prog), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def restrict(
    uid: int | None,
    keep_caps: set[int] | None,
    no_new_privs: bool,
    filter_numbers: set[int] | None,
    err: int = 1,
    drop_caps: frozenset[int] = frozenset(),
    dumpable: bool = True,
) -> list[str]:
    """This process as a unit's service runs: ``uid`` (None: stay), capabilities cut to
    ``keep_caps`` (None: keep them all, but ``drop_caps``; the bounding set too), no new
    privileges, the seccomp filter allowing ``filter_numbers`` (None: no filter). Capabilities
    survive the uid change (as AmbientCapabilities= gives them to a User= service); without no
    new privileges the filter goes in while CAP_SYS_ADMIN is still held, and the capabilities
    are cut after it (capset is a call the unit allows). ``dumpable``: as after the exec that
    starts a service (a uid change without exec leaves a process not dumpable, which only
    CAP_SYS_PTRACE may inspect). Returns what was applied."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = []
    root = os.geteuid() == 0
    if root and (keep_caps is not None or drop_caps):
        for cap in range(64):
            if (keep_caps is not None and cap not in keep_caps) or cap in drop_caps:
                libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # past the last cap: EINVAL, fine
    if root and uid is not None and uid != 0:
        libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
        become(uid)
        libc.prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0)
        done.append(f"uid {uid}")
    admin_for_filter = filter_numbers is not None and not no_new_privs
    if admin_for_filter:
        set_capabilities(libc, None, set())
    else:
        set_capabilities(libc, keep_caps, set(drop_caps))
    done.append("no capabilities" if keep_caps == set() else
                f"capabilities kept: {sorted(keep_caps) if keep_caps is not None else 'all'}"
                + (f" but {sorted(drop_caps)}" if drop_caps else ""))  # fmt: skip
    if no_new_privs:
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        done.append("no new privileges")
    if filter_numbers is not None:
        install_filter(libc, filter_numbers, err)
        done.append(f"seccomp: {len(filter_numbers)} system calls allowed, the rest fail with "
                    f"errno {err}")  # fmt: skip
    if admin_for_filter:
        set_capabilities(libc, keep_caps, set(drop_caps))
    libc.prctl(PR_SET_DUMPABLE, 1 if dumpable else 0, 0, 0, 0)
    return done


def filter_numbers(service: dict[str, list[str]], extra: set[str] = frozenset()) -> set[int]:
    """The x86_64 numbers of the calls the unit's filter allows, and of ``extra``."""
    data_file = json.loads(SYSCALLS.read_text())
    names = allowed_syscalls(service, data_file["groups"]) | set(extra)
    return {data_file["x86_64"][n] for n in names if n in data_file["x86_64"]}


def filter_errno(service: dict[str, list[str]]) -> int:
    import errno as errno_names

    return int(getattr(errno_names, service.get("SystemCallErrorNumber", ["EPERM"])[-1]))


def unit_capabilities(service: dict[str, list[str]]) -> set[int]:
    """The capabilities the unit's service holds as its (non-root) User=: AmbientCapabilities=,
    within CapabilityBoundingSet= where that is given. An empty assignment resets the list."""

    def listed(key: str) -> set[int] | None:
        values = service.get(key)
        if values is None:
            return None
        after_reset = values[len(values) - 1 - values[::-1].index("") :] if "" in values else values
        return capability_numbers(" ".join(after_reset))

    ambient, bounding = listed("AmbientCapabilities") or set(), listed("CapabilityBoundingSet")
    return ambient if bounding is None else ambient & bounding


def apply_sandbox(service: dict[str, list[str]], uid: int) -> list[str]:
    """Become ``uid`` (when root), drop every capability, set no-new-privileges and install the
    unit's system-call filter. Returns what was applied."""
    numbers = None
    note = []
    if service.get("SystemCallFilter"):
        if os.uname().machine == "x86_64":
            numbers = filter_numbers(service)  # read while the files are readable
        else:
            note = [f"NO system-call filter: {SYSCALLS.name} records x86_64 numbers only"]
    keep = unit_capabilities(service)
    nnp = service.get("NoNewPrivileges") == ["yes"] or bool(service.get("SystemCallFilter"))
    return [*restrict(uid, keep, nnp, numbers, filter_errno(service)), *note]


# ------------------------------------------------------------------------------------------------
# What the scheduler does with the GPU: NVML, cuInit, the checkpoint API


def nvml_check() -> dict[str, object]:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return {"ok": False, "error": f"cannot load NVML: {exc}"}
    rc = nvml.nvmlInit_v2()
    if rc != 0:
        return {"ok": False, "error": f"nvmlInit_v2 returned {rc}"}
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
    driver = ctypes.create_string_buffer(96)
    if hasattr(nvml, "nvmlSystemGetDriverVersion"):
        nvml.nvmlSystemGetDriverVersion(driver, 96)
    gpus = []
    for i in range(count.value):
        handle = ctypes.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle))
        name = ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetName(handle, name, 96)
        mem = (ctypes.c_ulonglong * 3)()  # total, free, used
        nvml.nvmlDeviceGetMemoryInfo(handle, mem)
        uuid = ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetUUID(handle, uuid, 96)
        util = (ctypes.c_uint * 2)()  # gpu, memory (percent)
        util_rc = nvml.nvmlDeviceGetUtilizationRates(handle, util)
        gpu: dict[str, object] = {
            "name": name.value.decode(),
            "uuid": uuid.value.decode(),
            "total": mem[0],
            "used": mem[2],
            "utilization_rc": util_rc,
        }
        failed = util_rc != 0
        # What the scheduler reads to check kernels' memory claims: the processes on the GPU.
        if hasattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3"):
            n = ctypes.c_uint(0)
            rc = nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(n), None)
            # 0, or 7 (insufficient size: there are processes); 3 (not supported: some drivers
            # and vGPUs list no processes) is no sandbox's doing, and the scheduler copes
            gpu["processes_rc"] = rc
            failed = failed or rc not in (0, 3, 7)
        gpu["ok"] = not failed
        gpus.append(gpu)
    ok = count.value > 0 and all(g["ok"] for g in gpus)
    return {"ok": ok, "driver": driver.value.decode(), "gpus": gpus}


def gpu0_used() -> int:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    handle = ctypes.c_void_p()
    nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))
    mem = (ctypes.c_ulonglong * 3)()
    nvml.nvmlDeviceGetMemoryInfo(handle, mem)
    return int(mem[2])


def checkpoint_check(cuda: ctypes.CDLL, pid: int, measure: bool = True) -> dict[str, object]:
    """Lock, checkpoint, restore and unlock ``pid``, as the scheduler's deep idle does; with
    ``measure``, NVML must see the program's memory go (the bisect's probes, several at once,
    skip it). A call that fails is named with its CUresult; a lock that held is let go."""
    out: dict[str, object] = {}
    lock_args = (ctypes.c_uint64 * 8)(10_000)  # timeoutMs 10 s, the rest reserved (zero)
    zero = (ctypes.c_uint64 * 8)()
    state = ctypes.c_int(-1)
    before = gpu0_used() if measure else 0
    for call, args in (("cuCheckpointProcessLock", lock_args),
                       ("cuCheckpointProcessCheckpoint", zero)):  # fmt: skip
        rc = getattr(cuda, call)(pid, ctypes.byref(args))
        if rc != 0:
            if call != "cuCheckpointProcessLock":
                cuda.cuCheckpointProcessUnlock(pid, ctypes.byref(zero))
            return {"ok": False, "error": f"{call} returned {rc}", "call": call, "result": rc}
    cuda.cuCheckpointProcessGetState(pid, ctypes.byref(state))
    out["state_after_checkpoint"] = state.value  # 2: CU_PROCESS_STATE_CHECKPOINTED
    if measure:
        time.sleep(0.5)
        asleep = gpu0_used()
        out["gpu0_used_mib"] = {"before": before >> 20, "checkpointed": asleep >> 20}
    for call in ("cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"):
        rc = getattr(cuda, call)(pid, ctypes.byref(zero))
        if rc != 0:
            return {**out, "ok": False, "error": f"{call} returned {rc}", "call": call,
                    "result": rc}  # fmt: skip
    out["ok"] = state.value == 2
    if measure:
        out["gpu0_used_mib"]["restored"] = gpu0_used() >> 20  # type: ignore[index]
        # Where NVML sees the program's memory (a real driver), the checkpoint must free it.
        out["ok"] = out["ok"] and (before < TARGET_BYTES or before - asleep >= TARGET_BYTES)
    return out


def opened_devices() -> dict[str, tuple[str, int, int]]:
    """The device nodes this process holds open or mapped."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/"):
            paths.add(fields[5].strip())
    return {p: n for p in sorted(paths) if p.startswith("/dev/") and (n := node_of(p))}


def inside(args: argparse.Namespace) -> int:
    """The checks, in the sandbox (applied here unless systemd applied it). The CUDA program to
    checkpoint is this process's child, as a kernel is its Jupyter server's (the checkpoint
    agent's): Yama's ptrace_scope 1 lets a process trace its descendants only. Started before
    the sandbox is applied here, it runs outside it, as kernels run outside the scheduler's
    (under systemd-run it runs inside: stricter)."""
    report: dict[str, object] = {}
    service = unit_service(args.unit)
    tgt, pid, said = spawn_target("own", args.uid)
    assert tgt.stdin and tgt.stdout
    if args.apply:
        report["sandbox"] = apply_sandbox(service, args.uid)
    report["uid"] = os.geteuid()
    report["nvml"] = nvml_check()
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        report["cuInit"] = {"ok": False, "error": f"cannot load the CUDA driver: {exc}"}
        print(json.dumps(report))
        return 0
    version = ctypes.c_int()
    rc = cuda.cuInit(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    report["cuInit"] = {"ok": rc == 0, "result": rc, "cuda_driver_version": version.value}
    if not pid:
        report["checkpoint"] = {"ok": False, "error": f"the CUDA program did not start: {said}"}
    elif rc == 0:
        report["checkpoint"] = checkpoint_check(cuda, pid)
        tgt.stdin.write("check\n")
        tgt.stdin.flush()
        report["data_after_restore"] = tgt.stdout.readline().strip()
    report["devices"] = opened_devices()
    with contextlib.suppress(OSError):
        report["ptrace_scope"] = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    tgt.kill()
    tgt.wait()
    print(json.dumps(report))
    return 0


def probe(args: argparse.Namespace) -> int:
    """One probe of ``--bisect`` (sandbox_bisect.py plans them): its target started, its part
    of the sandbox applied to this process, the checkpoint calls made; one JSON line."""
    spec = json.loads(args.probe)
    service = unit_service(args.unit)
    numbers = filter_numbers(service, set(spec["allow"])) if spec["seccomp"] else None
    keep = None if spec["keep_caps"] is None else capability_numbers(spec["keep_caps"])
    target_uid = args.other_uid if spec["target"].startswith("other") else args.uid
    tgt, pid, said = spawn_target(spec["target"], target_uid, mib=64)
    assert tgt.stdin and tgt.stdout
    out: dict[str, object] = {"target_uid": target_uid}
    if not pid:
        print(json.dumps({**out, "ok": None, "error": f"the CUDA program did not start: {said}"}))
        return 0
    cuda = ctypes.CDLL(
        "libcuda.so.1"
    )  # loaded as root: a test's stand-in may be in a closed folder
    out["sandbox"] = restrict(args.uid if spec["uid"] else None, keep, spec["no_new_privs"],
                              numbers, filter_errno(service),
                              frozenset(capability_numbers(spec["drop_caps"])),
                              spec["checker_dumpable"])  # fmt: skip
    rc = cuda.cuInit(0)
    if rc != 0:
        print(json.dumps({**out, "ok": False, "error": f"cuInit returned {rc}", "result": rc}))
        return 0
    out |= checkpoint_check(cuda, pid, measure=False)
    if out["ok"] or out.get("call") == "cuCheckpointProcessLock":  # else it may still be locked
        tgt.stdin.write("check\n")
        tgt.stdin.flush()
        out["data"] = tgt.stdout.readline().strip()
        out["ok"] = out["ok"] and out["data"] == "intact"
    print(json.dumps(out))
    return 0


TARGET_BYTES = 256 << 20
PATTERN = 0x5EED1E55


def spawn_target(kind: str, uid: int, mib: int = 256) -> tuple[subprocess.Popen[str], int, str]:
    """The CUDA program to checkpoint, of ``uid``: it, its pid (0: it did not start) and what it
    said. It changes uid itself (when started by root) and, but for ``legacy``, makes itself
    dumpable again, as the exec that starts a kernel as its user would: a uid change without
    exec leaves a process not dumpable, which only CAP_SYS_PTRACE may inspect (so the program
    was made up to 2bfe97e). ``detached``: no longer this process's descendant."""
    argv = [sys.executable, "-I", __file__, "--target", f"--mib={mib}", f"--uid={uid}"]
    argv += {"legacy": ["--legacy"]}.get(kind, ["--detach"] if kind.endswith("detached") else [])
    tgt = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert tgt.stdout
    said = tgt.stdout.readline().strip()
    ready = said.split()[1:] if said.startswith("ready ") else []
    return tgt, int(ready[0]) if ready else 0, said or f"exit {tgt.poll()}"


def target(args: argparse.Namespace) -> int:
    """A small CUDA program: ``--mib`` (256) filled with a pattern; checks it after a line on
    stdin. Says ``ready PID`` once its memory is filled."""
    if args.detach and os.fork() != 0:
        os._exit(0)  # the program goes on in the child, whose parent is gone
    try:
        cuda = ctypes.CDLL("libcuda.so.1")  # before the uid change, as the checker loads it
    except OSError as exc:
        print(f"error cannot load the CUDA driver: {exc}", flush=True)
        return 1
    if os.geteuid() == 0 and args.uid != 0:
        become(args.uid)
        if not args.legacy:
            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    size = args.mib << 20
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    calls = [("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
             ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), 0)), ("cuCtxSetCurrent", (ctx,)),
             ("cuMemAlloc_v2", (ctypes.byref(ptr), size))]  # fmt: skip
    for name, call_args in calls:
        rc = getattr(cuda, name)(*call_args)
        if rc != 0:
            print(f"error {name} returned {rc}", flush=True)
            return 1
    cuda.cuMemsetD32_v2(ptr, PATTERN, size // 4)
    cuda.cuCtxSynchronize()
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    host = (ctypes.c_uint32 * (size // 4))()
    rc = cuda.cuMemcpyDtoH_v2(host, ptr, size)
    intact = rc == 0 and all(v == PATTERN for v in host[::4096])
    print("intact" if intact else f"corrupt (copy returned {rc})", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# The driver


#: The unit's keys that systemd-run passes on as they are: its sandbox. ProtectHome and
#: PrivateTmp stay out: they hide where a python3 may live (/root, a home), not the GPU.
SANDBOX_KEYS = ("DevicePolicy", "DeviceAllow", "NoNewPrivileges", "CapabilityBoundingSet",
                "AmbientCapabilities", "ProtectSystem", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                "ProtectClock", "ProtectHostname", "RestrictNamespaces", "RestrictRealtime",
                "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures",
                "RestrictAddressFamilies", "SystemCallFilter", "SystemCallErrorNumber",
                "PrivateMounts", "UMask")  # fmt: skip


def systemd_runs() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemd-run") is not None


def run_inside(args: argparse.Namespace, use_systemd: bool) -> dict[str, object]:
    here = [sys.executable, "-I"]
    # A checkout in a home may not be readable by --uid (the checks and their CUDA program run
    # as it): the scripts go to a folder everyone may read, in /run for systemd-run (its
    # PrivateTmp would hide /tmp).
    tmp = copy_scripts(args.unit, "/run" if use_systemd else None)
    if use_systemd:
        props = [f"--property={k}={v}" for k, vs in unit_service(args.unit).items()
                 if k in SANDBOX_KEYS for v in vs]  # fmt: skip
        user = [f"--uid={args.uid}"] if args.uid else []
        argv = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", *user, *props,
                *here, str(tmp / Path(__file__).name), "--inside", f"--uid={args.uid}",
                f"--unit-file={tmp / args.unit.name}"]  # fmt: skip
    else:
        argv = [*here, str(tmp / Path(__file__).name), "--inside", "--apply",
                f"--uid={args.uid}", f"--unit-file={tmp / args.unit.name}"]  # fmt: skip
        if shutil.which("strace") and not args.no_strace:
            argv = ["strace", "-f", "-qq", "-c", "-o", str(tmp / "strace"), *argv]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        calls = strace_summary(tmp / "strace")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": f"exit {out.returncode}: {out.stdout[-2000:]}{out.stderr[-2000:]}"}
    return {**json.loads(lines[-1]), **({"syscalls": calls} if calls else {})}


def copy_scripts(unit: Path, where: str | None = None) -> Path:
    """This script, the module beside it, the system-call groups and ``unit`` in a new folder
    every user may read; the caller removes it."""
    tmp = Path(tempfile.mkdtemp(prefix="gpushare-check-", dir=where))
    os.chmod(tmp, 0o755)
    for f in (Path(__file__), HERE / "sandbox_bisect.py", SYSCALLS, unit):
        shutil.copy(f, tmp / f.name)
        os.chmod(tmp / f.name, 0o644)
    return tmp


#: What this script calls before it installs the filter (systemd does these before the exec).
OWN_CALLS = {"setgroups", "setresgid", "setresuid"}


def strace_summary(path: Path) -> dict[str, list[int]]:
    """``strace -c``'s table: system call -> [calls, errors]."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(\d+)?\s*([a-z_0-9]+)$", line)
        if m and m[3] != "total":
            out[m[3]] = [int(m[1]), int(m[2] or 0)]
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unit-file", dest="unit", type=Path, default=UNIT)
    parser.add_argument(
        "--uid",
        type=int,
        default=65534 if os.geteuid() == 0 else os.geteuid(),
        help="the unprivileged uid the checks run as (the unit's User=)",
    )
    parser.add_argument(
        "--no-systemd",
        action="store_true",
        help="apply the sandbox in-process even where systemd runs",
    )
    parser.add_argument(
        "--no-strace",
        action="store_true",
        help="do not record the system calls with strace (where installed)",
    )
    parser.add_argument(
        "--bisect",
        action="store_true",
        help="as root: which part of the sandbox stops the checkpoint, and what lets it through "
        "(one JSON result; sandbox_bisect.py)",
    )
    parser.add_argument("--other-uid", type=int, default=65533, help="--bisect's other user")
    parser.add_argument("--jobs", type=int, default=8, help="--bisect's probes run at once")
    parser.add_argument("--budget", type=float, default=38.0, help="--bisect's seconds")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--apply", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--detach", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--legacy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mib", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    if args.target:
        return target(args)
    if args.probe:
        return probe(args)
    if args.bisect:
        return bisect(args)
    use_systemd = systemd_runs() and not args.no_systemd
    print(f"unit: {args.unit}")
    print(f"sandbox applied by: {'systemd-run' if use_systemd else 'this script (no systemd)'}")
    report = run_inside(args, use_systemd)
    data = report.get("data_after_restore")
    print(json.dumps({k: v for k, v in report.items() if k != "syscalls"}, indent=1))
    failures = []
    if "error" in report:
        failures.append(f"the checks did not run: {report['error']}")
    for name in ("nvml", "cuInit", "checkpoint"):
        part = report.get(name)
        if isinstance(part, dict) and not part.get("ok"):
            failures.append(f"{name}: {part}")
        elif "error" not in report and part is None:
            failures.append(f"{name}: not reached")
    if data != "intact":
        failures.append(f"the checkpointed program's data after restore: {data}")
    service = unit_service(args.unit)
    proc_devices = Path("/proc/devices").read_text()
    devices = report.get("devices", {})
    assert isinstance(devices, dict)
    nodes = {p: n for p in service.get("DeviceAllow", []) if (n := node_of(p.split()[0]))}
    rules = device_rules(service, proc_devices, {p.split()[0]: n for p, n in nodes.items()})
    for path, (kind, major, minor) in devices.items():
        verdict = "allowed" if device_allowed(rules, kind, major, minor, "rw") else "DENIED"
        print(f"device {path} ({kind} {major}:{minor}): {verdict} by the unit's DeviceAllow")
        if verdict == "DENIED":
            failures.append(f"{path} is not in the unit's DeviceAllow")
    calls = report.get("syscalls", {})
    assert isinstance(calls, dict)
    allowed = allowed_syscalls(service, syscall_groups())
    for name, (count, errors) in sorted(calls.items()):
        # A call the filter stops fails (EPERM); the CUDA program's, outside it, do not.
        if name not in allowed and name not in OWN_CALLS and errors:
            print(f"system call {name}: {count} calls, {errors} failed: DENIED by the unit")
    if calls:
        made = " ".join(sorted(calls))
        print(f"system calls made (with the CUDA program's and the start's): {made}")
    nvidia = [line for line in proc_devices.splitlines() if "nvidia" in line]
    print("/proc/devices:", "; ".join(s.strip() for s in nvidia))
    print(f"checkpointed program's data: {data}")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("PASS: NVML, cuInit and a checkpoint work in the unit's sandbox" if not failures
          else f"{len(failures)} check(s) failed")  # fmt: skip
    return 1 if failures else 0


def bisect(args: argparse.Namespace) -> int:
    """``--bisect``: the probes sandbox_bisect.py plans, each a child of this script, run from
    a copy everyone may read; one JSON result on stdout. Exit status 0 when the unit's sandbox
    lets a process checkpoint its own user's program, 1 when not, 2 when it could not tell."""
    import sandbox_bisect

    if os.geteuid() != 0 or os.uname().machine != "x86_64":
        print(
            json.dumps(
                {
                    "error": "--bisect runs as root on x86_64 (it changes uid and "
                    "capabilities, and the recorded system-call numbers are x86_64's)"
                }
            )
        )
        return 2
    data = json.loads(SYSCALLS.read_text())
    allowed = allowed_syscalls(unit_service(args.unit), data["groups"])
    numbered = set(data["x86_64"])
    ctx = sandbox_bisect.Context(sandbox_bisect.denied_groups(data["groups"], allowed, numbered))
    tmp = copy_scripts(args.unit)
    base = [sys.executable, "-I", str(tmp / Path(__file__).name), f"--uid={args.uid}",
            f"--other-uid={args.other_uid}", f"--unit-file={tmp / args.unit.name}"]  # fmt: skip
    try:
        report = sandbox_bisect.run(ctx, base, jobs=args.jobs, budget=args.budget)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(OSError):
        report["ptrace_scope"] = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    report |= {"unit": str(args.unit), "uid": args.uid, "other_uid": args.other_uid}
    print(json.dumps(report))
    verdict: dict[str, object] = report["verdict"]  # type: ignore[assignment]
    for key in ("findings", "unit_lines", "drop_in_lines"):
        for line in verdict[key]:  # type: ignore[attr-defined]
            print(f"{key}: {line}", file=sys.stderr)
    return {True: 0, False: 1}.get(verdict["own_user_checkpoint_under_unit"], 2)  # type: ignore


def regenerate_syscalls(path: Path = SYSCALLS) -> None:
    """sandbox-syscalls.json from this machine's systemd-analyze and kernel headers (x86_64)."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    version = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True,
                             check=True).stdout.split("\n")[0]  # fmt: skip
    groups: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = line.strip()
            groups[current] = []
        elif line.startswith("    ") and current and not line.strip().startswith("#"):
            groups[current].append(line.strip())
        elif not line.strip():
            current = None
    groups.pop("@known", None)
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h").read_text()
    numbers = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", header)}
    source = json.dumps(f"systemd-analyze syscall-filter ({version}); asm/unistd_64.h")
    lines = ["{", f' "source": {source},', ' "groups": {']
    lines += [f"  {json.dumps(g)}: {json.dumps(names)}," for g, names in groups.items()]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" },", ' "x86_64": {']
    lines += [f"  {json.dumps(n)}: {nr}," for n, nr in sorted(numbers.items(), key=lambda i: i[1])]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" }", "}"]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate-syscalls"]:
        regenerate_syscalls()
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
