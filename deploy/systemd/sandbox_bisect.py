"""Which part of gpushare-scheduler.service's sandbox stops the driver's process checkpoint, and
what would let it through: the plan and the reading of ``check_sandbox.py --bisect``.

Pure functions, no I/O: :func:`plan_next` says which probes to run given the results so far,
:func:`interpret` reads the results. Each probe is one short child process of check_sandbox.py
that starts a small CUDA program (the target), applies part of the unit's sandbox to itself and
locks, checkpoints, restores and unlocks the target through the driver's API.

The sandbox's parts (:data:`COMPONENTS`): ``uid`` (the unit's User=: the checker runs as the
target's uid instead of root), ``caps`` (every capability dropped), ``no_new_privs`` and
``seccomp`` (the unit's SystemCallFilter). The targets (:data:`TARGETS`):

* ``own``: a program of the checker's uid, its child, started by exec as that user (as a kernel
  is by its Jupyter server, which is deep idle's checkpoint agent for it);
* ``other``: the same, of another uid (a kernel of another user: what the scheduler checkpoints
  itself when it may, CAP_SYS_PTRACE as the driver checks as ptrace does);
* ``detached``: of the checker's uid but not its descendant (Yama's ptrace_scope 1 allows a
  process to trace its descendants only); ``other-detached``: another user's, not a descendant
  (what a scheduler with CAP_SYS_PTRACE checkpoints itself);
* ``legacy``: of the checker's uid, made by changing uid without exec, as check_sandbox.py made it
  up to 2bfe97e: the kernel then marks it not dumpable, and only CAP_SYS_PTRACE may inspect it.

Rounds: first every part alone and every part left out (own target), the other user's target
with each candidate capability kept and each one left out (no seccomp filter there, so that the
capability question is answered apart from the filter's), the detached and legacy targets; then,
where the filter is to blame, the filter plus one system-call group at a time; then the calls of
the smallest group that helped, one at a time; last, the unit with what was found added.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

COMPONENTS = ("uid", "caps", "no_new_privs", "seccomp")
TARGETS = ("own", "other", "detached", "other-detached", "legacy")

#: Linux's capabilities (linux/capability.h), as units name them.
_CAPABILITY_NAMES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
    "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
    "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
    "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
    "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
    "CHECKPOINT_RESTORE"
)
CAPABILITIES = {f"CAP_{n}": number for number, n in enumerate(_CAPABILITY_NAMES.split(" "))}

#: Capabilities that could plausibly let one process checkpoint another's CUDA state: ptrace
#: access (/proc/PID/fd, pidfd_getfd, process_vm_*), checkpoint/restore, the catch-all, file
#: permission overrides (a pipe or file of another uid), signals, memory locking.
CANDIDATE_CAPS = ("CAP_SYS_PTRACE", "CAP_CHECKPOINT_RESTORE", "CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE",
                  "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_KILL", "CAP_IPC_LOCK")  # fmt: skip


def capability_numbers(names: str | list[str] | tuple[str, ...]) -> set[int]:
    """``CAP_SYS_PTRACE CAP_KILL`` (a unit's spelling, ``~`` for "all but" not handled) ->
    numbers; an unknown name is an error."""
    words = names.split() if isinstance(names, str) else list(names)
    unknown = [w for w in words if w not in CAPABILITIES]
    if unknown:
        raise ValueError(f"unknown capabilities: {unknown}")
    return {CAPABILITIES[w] for w in words}


#: Groups that contain other groups: each of their calls is tried through the smaller groups.
SUPERGROUPS = ("@system-service", "@known")
#: The pseudo-group of the denied calls that are in no smaller group.
UNGROUPED = "(no group)"


@dataclass(frozen=True)
class Probe:
    """One check: the sandbox parts applied, on which target. ``keep_caps`` None keeps every
    capability but ``drop_caps`` (the part ``caps`` is off); a tuple keeps those names only.
    ``allow`` adds system calls to the unit's filter (when ``seccomp`` is on)."""

    name: str
    components: frozenset[str]
    target: str = "own"
    keep_caps: tuple[str, ...] | None = None
    drop_caps: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    checker_dumpable: bool = True

    def spec(self) -> dict[str, object]:
        """What the probe's child process is told (JSON)."""
        return {
            "name": self.name,
            "uid": "uid" in self.components,
            "keep_caps": None if self.keep_caps is None else list(self.keep_caps),
            "drop_caps": list(self.drop_caps),
            "no_new_privs": "no_new_privs" in self.components,
            "seccomp": "seccomp" in self.components,
            "allow": list(self.allow),
            "target": self.target,
            "checker_dumpable": self.checker_dumpable,
        }  # fmt: skip


def probe(name: str, components: frozenset[str] | set[str], **kw: object) -> Probe:
    comps = frozenset(components)
    unknown = comps - set(COMPONENTS)
    if unknown:
        raise ValueError(f"unknown sandbox part(s): {sorted(unknown)}")
    keep = kw.pop("keep_caps", () if "caps" in comps else None)
    return Probe(name, comps, keep_caps=keep, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Context:
    """What the plan depends on: the system calls the unit's filter denies, by group (group ->
    its denied calls that this machine numbers), and the candidate capabilities."""

    denied: Mapping[str, tuple[str, ...]]
    caps: tuple[str, ...] = tuple(CANDIDATE_CAPS)
    sizes: Mapping[str, int] = field(default_factory=dict)


def denied_groups(
    groups: Mapping[str, list[str]], allowed: set[str], numbered: set[str]
) -> dict[str, tuple[str, ...]]:
    """Each group of systemd's (but the supergroups) that holds calls the filter denies, with
    those calls (the ones ``numbered`` on this machine), and :data:`UNGROUPED` for denied calls
    in no such group; groups denying nothing numbered are left out."""

    def expand(names: list[str], seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for n in names:
            if n.startswith("@"):
                if n not in seen and n in groups:
                    out |= expand(groups[n], seen | {n})
            else:
                out.add(n)
        return out

    out: dict[str, tuple[str, ...]] = {}
    covered: set[str] = set()
    for name in sorted(groups):
        if name in SUPERGROUPS:
            continue
        calls = tuple(sorted((expand([name]) - allowed) & numbered))
        if calls:
            out[name] = calls
            covered |= set(calls)
    rest = tuple(sorted(numbered - allowed - covered))
    if rest:
        out[UNGROUPED] = rest
    return out


UNIT = frozenset(COMPONENTS)


def _first_round(ctx: Context) -> list[Probe]:
    own = [probe("unit", UNIT), probe("none", set())]
    own += [probe(f"only:{c}", {c}) for c in COMPONENTS]
    own += [probe(f"without:{c}", UNIT - {c}) for c in COMPONENTS]
    # Another user's program: the capability question, apart from the filter's.
    no_filter = {"uid", "caps", "no_new_privs"}
    other = [probe("other:no-caps", no_filter, target="other"),
             probe("other:all-caps", no_filter - {"caps"}, target="other")]  # fmt: skip
    other += [probe(f"other:keep:{c}", no_filter, target="other", keep_caps=(c,))
              for c in ctx.caps]  # fmt: skip
    other += [probe(f"other:all-but:{c}", no_filter - {"caps"}, target="other",
                    drop_caps=(c,)) for c in ctx.caps]  # fmt: skip
    detached = [probe("detached:unit", UNIT, target="detached"),
                probe("detached:keep:CAP_SYS_PTRACE", UNIT, target="detached",
                      keep_caps=("CAP_SYS_PTRACE",))]  # fmt: skip
    # The unit with CAP_SYS_PTRACE (deploy/systemd's drop-in), on what the scheduler would then
    # checkpoint itself: another user's program that is not its descendant.
    drop_in = [
        probe("ptrace-drop-in", UNIT, target="other-detached", keep_caps=("CAP_SYS_PTRACE",))
    ]
    legacy = [probe("legacy", UNIT, target="legacy", checker_dumpable=False),
              probe("legacy:target", UNIT, target="legacy"),
              probe("legacy:checker", UNIT, checker_dumpable=False)]  # fmt: skip
    return own + other + detached + drop_in + legacy


def seccomp_to_blame(passed: Mapping[str, bool | None]) -> bool:
    return passed.get("unit") is False and passed.get("without:seccomp") is True


def _group_round(ctx: Context, passed: Mapping[str, bool | None]) -> list[Probe]:
    """The filter to blame: one group at a time added to it. The capabilities to blame (for
    the own user's program): one kept at a time."""
    out = []
    if seccomp_to_blame(passed):
        out += [probe(f"unit+{g}", UNIT, allow=calls) for g, calls in ctx.denied.items()]
    if passed.get("unit") is False and passed.get("without:caps") is True:
        out += [probe(f"unit+keep:{c}", UNIT, keep_caps=(c,)) for c in ctx.caps]
    return out


def helping_groups(ctx: Context, passed: Mapping[str, bool | None]) -> list[str]:
    """The groups whose calls, added to the filter, let the checkpoint through: fewest calls
    first."""
    ok = [g for g in ctx.denied if passed.get(f"unit+{g}") is True]
    return sorted(ok, key=lambda g: (len(ctx.denied[g]), g))


def _call_round(ctx: Context, passed: Mapping[str, bool | None]) -> list[Probe]:
    groups = helping_groups(ctx, passed)
    if not groups:
        return []
    return [probe(f"unit+{c}", UNIT, allow=(c,)) for c in ctx.denied[groups[0]]]


def needed_calls(ctx: Context, passed: Mapping[str, bool | None]) -> list[str]:
    """What to add to the filter: one call that suffices alone, else the smallest group's calls
    (empty: the filter is not to blame, or nothing tried helped)."""
    groups = helping_groups(ctx, passed)
    if not groups:
        return []
    single = [c for c in ctx.denied[groups[0]] if passed.get(f"unit+{c}") is True]
    return single[:1] if single else list(ctx.denied[groups[0]])


def caps_for_other_users(ctx: Context, passed: Mapping[str, bool | None]) -> dict[str, object]:
    """Which capabilities let a process of another uid be checkpointed: ``sufficient`` (each
    alone did), ``necessary`` (leaving each out of all of them failed), and ``needed``: the set
    to grant (the necessary ones where they exist, else the first sufficient one)."""
    sufficient = [c for c in ctx.caps if passed.get(f"other:keep:{c}") is True]
    necessary = [c for c in ctx.caps if passed.get("other:all-caps") is True
                 and passed.get(f"other:all-but:{c}") is False]  # fmt: skip
    needed = necessary or sufficient[:1]
    own = [c for c in ctx.caps if passed.get(f"unit+keep:{c}") is True]
    return {"sufficient": sufficient, "necessary": necessary, "needed": needed, "own_user": own}


def _proposal_round(ctx: Context, passed: Mapping[str, bool | None]) -> list[Probe]:
    calls = tuple(needed_calls(ctx, passed))
    found = caps_for_other_users(ctx, passed)
    caps = tuple(found["needed"])  # type: ignore[arg-type]
    own_caps = tuple(found["own_user"][:1])  # type: ignore[index]
    out = []
    if calls or own_caps:
        out.append(probe("proposal:own", UNIT, allow=calls, keep_caps=own_caps))
    if caps:
        out.append(probe("proposal:other", UNIT, target="other", allow=calls, keep_caps=caps))
    return out


ROUNDS = (
    lambda ctx, passed: _first_round(ctx),
    _group_round,
    _call_round,
    _proposal_round,
)


def plan_next(ctx: Context, passed: Mapping[str, bool | None]) -> list[Probe]:
    """The next probes to run (none left: done). ``passed`` maps each probe run so far to its
    outcome (None: it did not run or broke)."""
    for stage in ROUNDS:
        todo = [p for p in stage(ctx, passed) if p.name not in passed]
        if todo:
            return todo
    return []


def interpret(ctx: Context, passed: Mapping[str, bool | None]) -> dict[str, object]:
    """What the results say, and the unit change they call for."""
    unit = passed.get("unit")
    culprits = [c for c in COMPONENTS if unit is False and passed.get(f"without:{c}") is True]
    findings: list[str] = []
    if unit is True:
        findings.append("the unit's sandbox lets a process checkpoint its own user's programs")
    elif unit is False and passed.get("none") is False:
        findings.append("the checkpoint fails even with no sandbox: not the sandbox's doing")
    elif unit is False and not culprits:
        findings.append("no single part is to blame: see the only:* and without:* probes")
    for c in culprits:
        findings.append(f"leaving out {c} lets the checkpoint through")
    calls = needed_calls(ctx, passed)
    if calls:
        findings.append(f"the filter blocks the checkpoint; allowing {' '.join(calls)} fixes it")
    caps = caps_for_other_users(ctx, passed)
    legacy = passed.get("legacy")
    if legacy is False and unit is True:
        why = [n for n, d in (("target", "legacy:target"), ("checker", "legacy:checker"))
               if passed.get(d) is False]  # fmt: skip
        findings.append(
            "the failure recorded at 2bfe97e was the check's own: a program that "
            f"changed uid without exec is not dumpable ({', '.join(why) or '?'})"
        )
    # For the unit as it is meant (kernels checkpointed by their own user's agent, the
    # scheduler only its own user's programs): what the own user's check needed.
    unit_lines = [f"SystemCallFilter={' '.join(calls)}"] if calls else []
    if caps["own_user"]:
        first = caps["own_user"][0]  # type: ignore[index]
        unit_lines += [f"CapabilityBoundingSet={first}", f"AmbientCapabilities={first}"]
    # For the scheduler to checkpoint every user's kernel itself (no agent): the drop-in's.
    drop_in_lines = []
    if caps["needed"]:
        names = " ".join(caps["needed"])  # type: ignore[arg-type]
        drop_in_lines = [f"CapabilityBoundingSet={names}", f"AmbientCapabilities={names}"]
    return {
        "own_user_checkpoint_under_unit": unit,
        "culprits": culprits,
        "syscalls_needed": calls,
        "syscall_groups_that_helped": helping_groups(ctx, passed),
        "other_user": {
            "under_unit": passed.get("other:no-caps"),
            "with_all_caps": passed.get("other:all-caps"),
            **caps,
        },
        "other_user_not_descendant_with_CAP_SYS_PTRACE": passed.get("ptrace-drop-in"),
        "not_descendant": {
            "under_unit": passed.get("detached:unit"),
            "with_CAP_SYS_PTRACE": passed.get("detached:keep:CAP_SYS_PTRACE"),
        },
        "legacy_target_as_at_2bfe97e": legacy,
        "proposal_tested": {k: v for k, v in passed.items() if k.startswith("proposal:")},
        "unit_lines": unit_lines,
        "drop_in_lines": drop_in_lines,
        "findings": findings,
    }


# ------------------------------------------------------------------------------------------------
# Running the plan (the one part with I/O): each probe a child process, several at once


def outcome(report: Mapping[str, object] | None) -> bool | None:
    """A probe's report -> passed (True), refused (False) or did not tell (None)."""
    if not report or report.get("ok") is None:
        return None
    return bool(report["ok"])


def run(
    ctx: Context, base_argv: list[str], jobs: int = 8, budget: float = 38.0
) -> dict[str, object]:
    """Run the plan's probes (``base_argv`` + ``--probe SPEC``), ``jobs`` at once, round after
    round, none started after ``budget`` seconds; each gets at most 20 s and ends at most 3 s
    past the budget; its process group is killed after it (its CUDA program with it)."""
    import contextlib
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    start = time.monotonic()
    reports: dict[str, dict[str, object]] = {}

    def one(p: Probe) -> dict[str, object]:
        left = budget - (time.monotonic() - start)
        if left < 1:
            return {"ok": None, "error": "not run: out of time"}
        began = time.monotonic()
        child = subprocess.Popen([*base_argv, "--probe", json.dumps(p.spec())],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)  # fmt: skip
        try:
            out, err = child.communicate(timeout=min(20.0, left + 3))
        except subprocess.TimeoutExpired:
            out, err = "", "timed out"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        rep = json.loads(lines[-1]) if lines else {"ok": None, "error": err.strip()[-500:]}
        rep["seconds"] = round(time.monotonic() - began, 2)
        if p.name != "unit":
            rep.pop("sandbox", None)  # what was applied: the name says it
        word = {True: "pass", False: "FAIL"}.get(outcome(rep), "?")  # type: ignore[arg-type]
        print(f"{p.name}: {word} {rep.get('error', '')} ({rep['seconds']} s)", file=sys.stderr)
        return rep

    passed: dict[str, bool | None] = {}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        while batch := plan_next(ctx, passed):
            for p, rep in zip(batch, pool.map(one, batch), strict=True):
                reports[p.name] = rep
                passed[p.name] = outcome(rep)
    return {
        "verdict": interpret(ctx, passed),
        "seconds": round(time.monotonic() - start, 1),
        "probes": reports,
    }
