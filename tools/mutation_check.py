"""Mutation check: do the tests notice when the code they cover is wrong?

Each mutant below is one small change to the scheduling policy's core
(``jupyter_gpushare/scheduler/core``), the shim's code that moves and defers memory
(``native/src/memory``) or an access check (``jupyter_gpushare/scheduler/shell/access.py``, the
shim's check of the scheduler's socket). For each, the script puts the change in the working
tree, runs the tests named for it, and puts the file back as it was, whatever happens (an error,
Ctrl-C, SIGTERM). A mutant is **killed** when its tests fail; one whose tests pass **survived**:
a wrong program that the suite accepts.

Each mutant names a few fast tests, the ones that should catch it, not the suite: the check
asks whether the right tests bite, and a run of every mutant takes minutes, not hours (a native
mutant rebuilds the shim, about 20 s on two idle cores). Before the mutants, each distinct
selection is run once unchanged: a selection that fails on the real code would kill every mutant
and prove nothing (``--no-baseline`` skips this).

    python3 tools/mutation_check.py                    # every mutant
    python3 tools/mutation_check.py --only rank-level,defer-while-waiting
    python3 tools/mutation_check.py --list             # the mutants and their tests
    python3 tools/mutation_check.py --json out.json    # the results as JSON too

Exit status: 0 when every mutant was killed, 1 when one survived, 2 on a usage or tree error (a
mutant's text not found exactly once in its file: the code moved, update the mutant). The last
kill rate is recorded in docs/reliability.md; tests/test_mutation_check.py checks the list
against the tree on every run and runs the whole check in the slow tier.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # "policy", "shim memory" or "access"
    path: str  # relative to the repository root
    old: str  # found exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that should fail
    why: str  # what the change breaks, in words


CORE = "jupyter_gpushare/scheduler/core/"
ACCESS = "jupyter_gpushare/scheduler/shell/access.py"
VMM = "native/src/memory/"

MUTANTS: tuple[Mutant, ...] = (
    # -- the core policy ---------------------------------------------------------------------
    Mutant(
        "rank-level",
        "policy",
        CORE + "ordering.py",
        "0 if self.starved(k, now) else 1 + self.level(k)",
        "0 if self.starved(k, now) else 1",
        ("tests/policy/test_ordering_levels.py",),
        "waiters ranked without their cells' levels: fair share alone decides",
    ),
    Mutant(
        "starvation-window",
        "policy",
        CORE + "ordering.py",
        "now >= since + self.window",
        "now >= since + 2 * self.window",
        ("tests/policy/test_ordering.py",),
        "a paused long cell waits twice the starvation bound",
    ),
    Mutant(
        "gate-level",
        "policy",
        CORE + "ordering.py",
        "return self.level(w) <= gate or self.starved(w, now)",
        "return self.level(w) <= gate + 1 or self.starved(w, now)",
        ("tests/policy/test_ordering.py",),
        "a cell one level above the running ones is let through the gate",
    ),
    Mutant(
        "partial-eviction",
        "policy",
        CORE + "policy_moves.py",
        "    return min(have, blocks * BLOCK_BYTES)",
        "    return have",
        ("tests/policy/test_policy_partial.py",),
        "a kernel asked for room gives all its memory, not what is missing",
    ),
    Mutant(
        "cost-aware",
        "policy",
        CORE + "policy_moves.py",
        "return expected_left(h, now) > move_seconds(dev, nbytes, h)",
        "return True",
        ("tests/policy/test_policy_short.py", "tests/policy/test_policy_partial.py"),
        "a busy cell about to end is evicted though the move costs more than waiting",
    ),
    Mutant(
        "stuck-memory",
        "policy",
        CORE + "policy_moves.py",
        "c.stuck = max(0, c.movable - c.away)",
        "c.stuck = 0",
        ("tests/policy/test_policy_partial.py",),
        "memory a shim could not move is asked for again on every event (an EVICT storm)",
    ),
    Mutant(
        "short-cell",
        "policy",
        CORE + "policy_short.py",
        "not c.idle and order.level(c) == 0",
        "not c.idle and order.level(c) <= 1",
        ("tests/policy/test_policy_short.py",),
        "a cell past its first level still jumps the queue and pre-empts",
    ),
    Mutant(
        "overdue",
        "policy",
        CORE + "policy.py",
        "return now >= c.waiting_since + self.config.max_quantum",
        "return now >= c.waiting_since + 2 * self.config.max_quantum",
        ("tests/policy/test_policy_scenarios.py", "tests/policy/test_policy_properties.py"),
        "the bound on every wait (max_quantum) doubles",
    ),
    Mutant(
        "fair-share-weight",
        "policy",
        CORE + "policy.py",
        "        return used / c.weight",
        "        return used",
        ("tests/policy/test_policy_scenarios.py",),
        "weights no longer count in fair share",
    ),
    Mutant(
        "grew-past-pool",
        "policy",
        CORE + "policy.py",
        "while len(running) > 1 and total > dev.pool_bytes:",
        "while len(running) > 1 and total > dev.pool_bytes + dev.pool_bytes // 4:",
        ("tests/policy/test_policy_scenarios.py", "tests/policy/test_policy_properties.py"),
        "holders that grew a quarter past the pool are left running",
    ),
    Mutant(
        "quantum-from-moves",
        "policy",
        CORE + "policy.py",
        "return min(max(cfg.base_quantum, cfg.move_factor * move_time), cfg.max_quantum)",
        "return cfg.base_quantum",
        ("tests/policy/test_policy_scenarios.py", "tests/policy/test_policy_properties.py"),
        "a holder with much memory gets the base quantum: moving it dominates its turn",
    ),
    Mutant(
        "room-beside-idle",
        "policy",
        CORE + "policy_moves.py",
        "others = sum(o.on_gpu for o in dev.clients.values() if o is not c)",
        "others = sum(o.on_gpu for o in dev.clients.values() if o is not c and not o.idle)",
        ("tests/policy/test_policy_card.py", "tests/policy/test_policy_partial.py"),
        "a grant's room counts idle kernels' memory as free before it has left (issue 34)",
    ),
    # -- the shim's memory moves and deferral -----------------------------------------------
    Mutant(
        "defer-while-waiting",
        "shim memory",
        VMM + "vmm.c",
        "if (atomic_load(&gs_vmm_defer) & bit)",
        "if (0 && (atomic_load(&gs_vmm_defer) & bit))",
        ("tests/native/test_deferred_backing.py",),
        "memory allocated while the process waits is backed at once, beside the holder's",
    ),
    Mutant(
        "past-room",
        "shim memory",
        VMM + "vmm.c",
        "if (!gs_mem_past_room_on(dev, &backed, &room))",
        "if (1 || !gs_mem_past_room_on(dev, &backed, &room))",
        ("tests/native/test_memory_past_room.py",),
        "a holder's memory past its grant's room is backed anyway",
    ),
    Mutant(
        "stale-precopy",
        "shim memory",
        VMM + "move.c",
        "return b->precopied && b->precopy_mark == calls;",
        "return b->precopied;",
        ("tests/native/test_memory_engine.py::test_a_gpu_call_after_the_precopy_makes_it_stale",),
        "a host copy made before the program wrote again counts as current: the eviction "
        "copies nothing and the write is lost",
    ),
    Mutant(
        "eviction-order",
        "shim memory",
        VMM + "move.c",
        "    return a->last_use < b->last_use;",
        "    return a->last_use > b->last_use;",
        ("tests/native/test_partial_eviction.py",),
        "a partial eviction moves the most recently used blocks first",
    ),
    Mutant(
        "unmap-before-copy-check",
        "shim memory",
        VMM + "move.c",
        "if (r == 0 && !clean && settle_copy_out(b, check) != 0)",
        "if (0 && r == 0 && !clean && settle_copy_out(b, check) != 0)",
        (
            "tests/native/test_verify_moves.py::test_an_eviction_that_lost_its_start_is_copied_again",
        ),
        "a block is unmapped without its copy out checked",
    ),
    # -- access checks -------------------------------------------------------------------------
    Mutant(
        "token-uid-admin",
        "access",
        ACCESS,
        "if uid < 0 or uid in self.token_uids:",
        "if uid < 0:",
        ("tests/scheduler/test_security.py", "tests/scheduler/test_users_config.py"),
        "root or an admin uid shared by hub users makes every one of them an admin",
    ),
    Mutant(
        "others-kernels",
        "access",
        ACCESS,
        "return who.admin or (owner is not None and owner.user == who.user)",
        "return who.admin or owner is not None",
        ("tests/scheduler/test_scheduler_control.py", "tests/scheduler/test_security.py"),
        "any user may release, evict or re-quota another user's kernel",
    ),
    Mutant(
        "token-check",
        "access",
        ACCESS,
        "if not verify_token(self.files.key, claimed, token):",
        "if not token:",
        ("tests/scheduler/test_security.py",),
        "a peer on a shared uid is whoever it claims to be, token or not",
    ),
    Mutant(
        "terminate-others",
        "access",
        ACCESS,
        "return who is not None and who.user in set(kernel_users)",
        "return who is not None",
        ("tests/scheduler/test_access_rules.py",),
        "one hub user may have MPS end another's kernel",
    ),
    Mutant(
        "quota-ceiling",
        "access",
        ACCESS,
        "if ceiling == 0 or (quota != 0 and quota <= ceiling):",
        "if ceiling == 0 or (quota != 0 and quota <= 2 * ceiling):",
        ("tests/scheduler/test_access_rules.py",),
        "a user may set a quota up to twice the operator's ceiling",
    ),
    Mutant(
        "socket-dir-writable",
        "access",
        "native/src/client/socket_trust.c",
        "} else if (st.st_mode & (S_IWGRP | S_IWOTH)) {",
        "} else if (st.st_mode & S_IWOTH) {",
        ("tests/native/test_socket_trust.py",),
        "the shim trusts a socket in a directory its group may write",
    ),
)


@dataclass
class Result:
    name: str
    area: str
    outcome: str  # "killed", "survived", "killed (timeout)", "error"
    seconds: float
    detail: str  # the first failing test, or why it is an error


def check_tree(mutants: tuple[Mutant, ...] = MUTANTS) -> list[str]:
    """What is wrong with the list against the tree (empty: nothing): each mutant's text found
    exactly once, its change a change, its tests there, the names unique."""
    problems = []
    names = [m.name for m in mutants]
    problems += [f"{n}: named twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in mutants:
        path = ROOT / m.path
        if not path.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its text is in {m.path} {count} times, not once")
        if m.old == m.new:
            problems.append(f"{m.name}: the change changes nothing")
        for test in m.tests:
            if not (ROOT / test.split("::")[0]).exists():
                problems.append(f"{m.name}: no tests at {test}")
    return problems


def run_tests(tests: tuple[str, ...], timeout: float) -> tuple[int | None, str, float]:
    """pytest on ``tests`` (stop at the first failure): (exit status or None on a timeout,
    the first failing test or the output's end, seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, f"no answer in {timeout:.0f} s", time.monotonic() - t0
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    tail = failed[0] if failed else "\n".join(out.strip().splitlines()[-3:])
    return proc.returncode, tail, time.monotonic() - t0


def apply_and_test(m: Mutant, timeout: float) -> Result:
    path = ROOT / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return Result(m.name, m.area, "error", 0.0, f"its text is not once in {m.path}")
    try:
        path.write_text(original.replace(m.old, m.new, 1))
        rc, detail, seconds = run_tests(m.tests, timeout)
    finally:
        path.write_text(original)
    if rc is None:
        return Result(m.name, m.area, "killed (timeout)", seconds, detail)
    if rc == 0:
        return Result(m.name, m.area, "survived", seconds, "every test passed")
    if rc == 1:
        return Result(m.name, m.area, "killed", seconds, detail)
    # 2: interrupted or a collection error, 3: internal error, 4: usage, 5: no tests collected
    return Result(m.name, m.area, "error", seconds, f"pytest exit status {rc}: {detail}")


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through apply_and_test's finally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--json", type=Path, help="write the results there")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    args = ap.parse_args(argv)

    chosen = MUTANTS
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {m.name for m in MUTANTS})
        if unknown:
            print(f"unknown mutant(s): {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        chosen = tuple(m for m in MUTANTS if m.name in wanted)
    if args.list:
        for m in chosen:
            print(f"{m.name} [{m.area}] {m.path}: {m.why}\n    tests: {' '.join(m.tests)}")
        return 0
    problems = check_tree(chosen)
    if problems:
        print("the mutants do not match the tree:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _stop)
    if not args.no_baseline:
        for tests in dict.fromkeys(m.tests for m in chosen):
            print(f"baseline: {' '.join(tests)} ...", flush=True)
            rc, detail, seconds = run_tests(tests, args.timeout)
            if rc != 0:
                print(f"  fails without a mutant ({detail}): fix that first", file=sys.stderr)
                return 2
            print(f"  passes ({seconds:.0f} s)", flush=True)
    results: list[Result] = []
    for i, m in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {m.name} ({m.area}): {m.why} ...", flush=True)
        r = apply_and_test(m, args.timeout)
        results.append(r)
        print(f"  {r.outcome} in {r.seconds:.0f} s: {r.detail}", flush=True)
    killed = [r for r in results if r.outcome.startswith("killed")]
    survived = [r for r in results if r.outcome == "survived"]
    errors = [r for r in results if r.outcome == "error"]
    rate = len(killed) / len(results) if results else 0.0
    print(f"\nkilled {len(killed)} of {len(results)} mutants ({rate:.0%})")
    for r in survived:
        print(f"  SURVIVED {r.name}: {next(m.why for m in chosen if m.name == r.name)}")
    for r in errors:
        print(f"  ERROR {r.name}: {r.detail}")
    if args.json:
        doc = {
            "killed": len(killed),
            "mutants": len(results),
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if not survived and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
