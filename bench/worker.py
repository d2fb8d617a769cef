"""The GPU side of the benchmarks: one process, PyTorch, optionally under the shim.

    python -m bench.worker serve          # JSON commands on stdin, one JSON answer per line
    python -m bench.worker replay FILE    # play one user's cells (bench/replay.py writes FILE)

``serve`` commands (``{"op": ...}``): ``init`` (create the CUDA context; done at start when
GPUSHARE_SOCKET is set, so that the shim registers before "ready"), ``alloc`` (bytes: a
persistent working set), ``touch``
(read and write the whole working set once), ``compute`` (iters: matmul iterations), ``launch1``
(one tiny kernel, then synchronise: "my first kernel ran"), ``calibrate``, ``memcpy`` (pinned
host<->device bandwidth), ``train`` (a small CNN, fixed steps), ``exit``. Every answer carries
``t`` = time.monotonic() when the operation finished (CLOCK_MONOTONIC: comparable across the
processes of one machine).

Cells are matmul bursts (bf16, 8192x8192: ~2 ms each on an H100) plus one pass over the
working set, so a cell's GPU time is ``iters * t_iter + touch(working set)``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

N = 8192  # matmul size: long enough per launch that the launch path is not what we measure

torch: Any = None  # imported by Worker(): the stand-in backend runs without PyTorch


class Worker:
    """The PyTorch backend (the real benchmarks)."""

    def __init__(self) -> None:
        global torch
        import torch as _torch

        torch = _torch
        self.dev = torch.device("cuda")
        # Under the shim, create the CUDA context now, with no kernel and no allocation: the
        # shim registers with the scheduler when the process first gets a context, and torch
        # makes contexts lazily. Without this a worker said "ready" before the scheduler knew
        # it, and the harness's first control message for it was answered "no client". Not
        # without a scheduler: a plain process (co-location) must make its context when the
        # harness says so (``init_context``), not wherever torch.cuda is first touched.
        if os.environ.get("GPUSHARE_SOCKET"):
            self.init_context()
        self.ws: list[torch.Tensor] | None = None
        self.ws_fresh = self.operands_fresh = False  # reserved, not yet written (reserve())
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.tiny: torch.Tensor | None = None
        self.ballast: torch.Tensor | None = None

    def _sync(self) -> None:
        torch.cuda.synchronize()

    def init_context(self) -> None:
        """Create the CUDA context (no kernel, no allocation)."""
        torch.cuda.mem_get_info()

    def alloc(self, nbytes: int, chunk: int = 0) -> None:
        """The working set: one tensor, or tensors of ``chunk`` bytes (see :func:`chunks`)."""
        if self.ws is not None and sum(t.numel() * 4 for t in self.ws) >= nbytes:
            if self.ws_fresh:
                for t in self.ws:
                    t.fill_(1.0)
                self.ws_fresh = False
                self._sync()
            return
        self.ws = None
        if nbytes > 0:
            self.ws = [
                torch.empty(n // 4, dtype=torch.float32, device=self.dev)
                for n in chunks(nbytes, chunk)
            ]
            for t in self.ws:
                t.fill_(1.0)
            self._sync()

    def reserve(self, nbytes: int, chunk: int = 0) -> None:
        """Allocate the working set and the matmul operands (with room for their product, kept
        in PyTorch's cache) without running a kernel. Under the shim a process that does not
        hold the device has its new memory deferred, so its first kernel's request carries all
        of it and the scheduler makes room before the grant, as for every later cell."""
        if self.ws is None and nbytes > 0:
            self.ws = [
                torch.empty(n // 4, dtype=torch.float32, device=self.dev)
                for n in chunks(nbytes, chunk)
            ]
            self.ws_fresh = True
        if self.a is None:
            self.a = torch.empty(N, N, dtype=torch.bfloat16, device=self.dev)
            self.b = torch.empty(N, N, dtype=torch.bfloat16, device=self.dev)
            product = torch.empty(N, N, dtype=torch.bfloat16, device=self.dev)
            del product
            self.operands_fresh = True

    def touch(self) -> None:
        for t in self.ws or []:
            t.add_(1.0)
        self._sync()

    def compute(self, iters: int) -> None:
        if self.a is None:
            self.a = torch.randn(N, N, dtype=torch.bfloat16, device=self.dev)
            self.b = torch.randn(N, N, dtype=torch.bfloat16, device=self.dev)
        assert self.b is not None
        if self.operands_fresh:  # reserved: as randn would have made them
            self.a.normal_()
            self.b.normal_()
            self.operands_fresh = False
        c = self.a
        for i in range(iters):
            c = torch.mm(self.a, self.b)
            if (i + 1) % STEP_ITERS == 0:
                # A training step that reads its loss: the queue of launched work stays short,
                # so a revoke (which waits for that work) takes effect within a step.
                self._sync()
        del c
        self._sync()

    def launch1(self) -> None:
        """One tiny kernel, then synchronise. A kernel that touches no memory where PyTorch has
        one (``torch.cuda._sleep``, a spin of a few cycles): a handoff "with no memory to move"
        then moves none, not even a small tensor."""
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda.init()  # _sleep may not initialise CUDA by itself
            torch.cuda._sleep(100)
        else:
            if self.tiny is None:
                self.tiny = torch.zeros(1, device=self.dev)
            self.tiny.add_(1.0)
        self._sync()

    def meminfo(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info()
        return {"free": int(free), "total": int(total)}

    def ballast_to(self, free: int) -> int:
        """Occupy the card (plain cudaMalloc) so that only ``free`` bytes stay free."""
        size = max(0, self.meminfo()["free"] - free)
        self.ballast = torch.empty(size, dtype=torch.uint8, device=self.dev)
        return size

    def drop_ws(self) -> None:
        """After a failed allocation: nothing half-made stays behind."""
        self.ws = None
        self.ws_fresh = False
        torch.cuda.empty_cache()

    @staticmethod
    def is_oom(exc: BaseException) -> bool:
        return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)

    def calibrate(self, ws_bytes: int) -> dict[str, Any]:
        """Solo costs: seconds per matmul iteration, and seconds per GiB of working-set touch."""
        self.compute(5)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            self.compute(20)
            times.append((time.perf_counter() - t0) / 20)
        self.alloc(ws_bytes)
        self.touch()
        touch = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.touch()
            touch.append(time.perf_counter() - t0)
        times.sort()
        touch.sort()
        return {
            "t_iter": times[len(times) // 2],
            "touch_s_per_gib": touch[len(touch) // 2] / max(ws_bytes / (1 << 30), 1e-9),
        }

    def memcpy(self, nbytes: int, repeats: int) -> dict[str, Any]:
        """Pinned host<->device copy bandwidth (bytes/s), median of ``repeats``."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        out: dict[str, list[float]] = {"h2d": [], "d2h": []}
        for _ in range(repeats + 1):
            self._sync()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            self._sync()
            t1 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            self._sync()
            t2 = time.perf_counter()
            out["h2d"].append(nbytes / (t1 - t0))
            out["d2h"].append(nbytes / (t2 - t1))
        res: dict[str, Any] = {"bytes": nbytes}
        for k, v in out.items():
            samples = v[1:]  # the first copy pays for first-touch and lazy setup
            res[k] = sorted(samples)[len(samples) // 2]
            res[k + "_samples"] = samples
            res[k + "_first"] = v[0]
        del host, dev
        return res

    def _train_state(self) -> Any:
        """A small ResNet (stem + four stages of one basic block, 64..512 channels) on a fixed
        batch of random 32x32 images, SGD with momentum. GPU-bound on purpose: convolutions of
        tens of milliseconds per step, so the launch path is a small part of a step and what is
        measured is what the shim does to a real training loop."""
        if getattr(self, "_train", None) is not None:
            return self._train
        nn = torch.nn
        torch.manual_seed(0)
        # Deterministic convolutions: plain and shimmed runs must then reach the same loss
        # (a shim that corrupted memory or launches would show here, not only in the time).
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

        def block(cin: int, cout: int, stride: int) -> Any:
            class Basic(nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.body = nn.Sequential(
                        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                        nn.BatchNorm2d(cout),
                        nn.ReLU(inplace=True),
                        nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                        nn.BatchNorm2d(cout),
                    )
                    self.skip = (
                        nn.Identity()
                        if stride == 1 and cin == cout
                        else nn.Sequential(
                            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                        )
                    )

                def forward(self, x: Any) -> Any:
                    return torch.relu(self.body(x) + self.skip(x))

            return Basic()

        class GlobalMean(nn.Module):
            # Not AdaptiveAvgPool2d: its CUDA backward uses atomics (not bit-reproducible), and
            # the plain and shimmed losses must be identical.
            def forward(self, x: Any) -> Any:
                return x.mean((2, 3))

        model = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            block(64, 64, 1),
            block(64, 128, 2),
            block(128, 256, 2),
            block(256, 512, 2),
            GlobalMean(),
            nn.Linear(512, 10),
        ).to(self.dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(self.TRAIN_BATCH, 3, 32, 32, device=self.dev)
        y = torch.randint(0, 10, (self.TRAIN_BATCH,), device=self.dev)
        self._train = (model, opt, x, y, nn.CrossEntropyLoss())
        return self._train

    TRAIN_BATCH = 512

    def train(self, steps: int, warmup: int) -> dict[str, Any]:
        """Train ``steps`` steps (after ``warmup`` untimed ones) of the persistent model: the
        median step time from CUDA events around every step (steady state, no host timer, no
        process start), the mean, and the loss. Successive calls continue the same training, so
        two processes given the same sequence of calls must report bit-identical losses."""
        model, opt, x, y, loss_fn = self._train_state()
        loss = None

        def step() -> Any:
            opt.zero_grad(set_to_none=True)
            out = loss_fn(model(x), y)
            out.backward()
            opt.step()
            return out

        for _ in range(warmup):
            loss = step()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        self._sync()
        events[0].record()
        for i in range(steps):
            loss = step()
            events[i + 1].record()
        self._sync()
        per = sorted(events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps))
        assert loss is not None
        return {
            "step_s": per[len(per) // 2],
            "step_s_mean": events[0].elapsed_time(events[-1]) / 1e3 / steps,
            "loss": float(loss.item()),
        }


#: Matmuls between two synchronisations in a cell (~25 ms of an H100 at N = 8192, bf16).
STEP_ITERS = 16


class StandinWorker:
    """The same operations on the tests' stand-in driver (no GPU, no PyTorch): ctypes calls
    into libcuda.so.1, whose "sleep" kernel keeps the stream busy. For checking the harnesses
    (tests/bench); its numbers measure nothing about a GPU."""

    T_ITER = 0.001  # seconds per "matmul iteration"
    CHUNK_US = 10_000  # the longest "kernel" compute() launches

    def __init__(self) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        cu.cuModuleGetFunction.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p
        ]  # fmt: skip
        cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
        self.cu = cu
        self._check(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        mod = ctypes.c_void_p()
        self._check(cu.cuModuleLoadData(ctypes.byref(mod), b"stand-in image"), "cuModuleLoadData")
        self.fn = ctypes.c_void_p()
        self._check(cu.cuModuleGetFunction(ctypes.byref(self.fn), mod, b"sleep"), "function")
        self.ws: list[int] | None = None
        self.ws_bytes = 0

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc == 2:
            raise MemoryError(f"{what}: out of memory (CUDA error 2)")
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA error {rc}")

    def _sleep(self, us: int) -> None:
        arg = ctypes.c_ulonglong(max(1, us))
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
        rc = self.cu.cuLaunchKernel(self.fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        self._check(rc, "launch")
        self._check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def alloc(self, nbytes: int, chunk: int = 0, launch: bool = True) -> None:
        if self.ws is not None and self.ws_bytes >= nbytes:
            return
        self.drop_ws()
        if nbytes > 0:
            self.ws = []
            for n in chunks(nbytes, chunk):
                ptr = ctypes.c_uint64()
                rc = self.cu.cuMemAlloc_v2(ctypes.byref(ptr), n)
                if rc == 0:
                    self.ws.append(ptr.value)
                self._check(rc, "cuMemAlloc")
            self.ws_bytes = nbytes
            if launch:
                self._sleep(1)

    def reserve(self, nbytes: int, chunk: int = 0) -> None:
        """The working set's allocations without a kernel (:meth:`Worker.reserve`)."""
        if self.ws is None and nbytes > 0:
            self.alloc(nbytes, chunk, launch=False)

    def drop_ws(self) -> None:
        for ptr in self.ws or []:
            self.cu.cuMemFree_v2(ptr)
        self.ws, self.ws_bytes = None, 0

    def touch(self) -> None:
        self._sleep(1)

    def compute(self, iters: int) -> None:
        # Many short kernels, as a real cell's matmuls are: the launch gate can pause between
        # them (one kernel of the whole cell could not be paused until it ended).
        left = int(iters * self.T_ITER * 1e6)
        while left > 0:
            self._sleep(min(left, self.CHUNK_US))
            left -= self.CHUNK_US

    def init_context(self) -> None:
        """The stand-in makes its context in __init__."""

    def launch1(self) -> None:
        self._sleep(1)

    def meminfo(self) -> dict[str, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "meminfo")
        return {"free": free.value, "total": total.value}

    def ballast_to(self, free: int) -> int:
        size = max(0, self.meminfo()["free"] - free)
        if size:
            self._check(self.cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), size), "ballast")
        return size

    @staticmethod
    def is_oom(exc: BaseException) -> bool:
        return isinstance(exc, MemoryError)

    def calibrate(self, ws_bytes: int) -> dict[str, Any]:
        return {"t_iter": self.T_ITER, "touch_s_per_gib": 1e-6}

    def memcpy(self, nbytes: int, repeats: int) -> dict[str, Any]:
        raise RuntimeError("memcpy needs a GPU")

    def train(self, steps: int, warmup: int) -> dict[str, Any]:
        raise RuntimeError("train needs PyTorch on a GPU")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def chunks(nbytes: int, chunk: int) -> list[int]:
    """A working set of ``nbytes`` as allocations of ``chunk`` bytes (the last one smaller;
    0: one allocation). A notebook holds many tensors, and the shim's engine evicts whole
    allocations: a working set in chunks can leave the GPU in part, as the simulator's
    blocks of ``chunk`` bytes do (bench/replay_nbmix.py)."""
    if chunk <= 0 or nbytes <= chunk:
        return [nbytes]
    return [chunk] * (nbytes // chunk) + ([nbytes % chunk] if nbytes % chunk else [])


def operand_bytes() -> int:
    """What a replay worker holds beside its working set: the matmul operands (a, b and the
    product, bf16 N x N each) with PyTorch; nothing on the stand-in (its "matmuls" are sleeps)."""
    return 0 if os.environ.get("GPUSHARE_BENCH_BACKEND") == "standin" else 3 * N * N * 2


def process_host_bytes() -> int:
    """A replay worker's own host memory, about: PyTorch with a CUDA context and its libraries
    (2 GiB); a small Python process on the stand-in."""
    return (128 << 20) if os.environ.get("GPUSHARE_BENCH_BACKEND") == "standin" else 2 << 30


def make_worker() -> Worker | StandinWorker:
    """PyTorch, unless GPUSHARE_BENCH_BACKEND=standin (the harnesses' tests)."""
    if os.environ.get("GPUSHARE_BENCH_BACKEND") == "standin":
        return StandinWorker()
    return Worker()


def serve() -> None:
    w = make_worker()
    print(json.dumps({"ready": True, "t": time.monotonic()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        ans: dict[str, Any] = {"op": op}
        try:
            if op == "init":
                w.init_context()
            elif op == "alloc":
                w.alloc(int(cmd["bytes"]))
            elif op == "touch":
                w.touch()
            elif op == "compute":
                w.compute(int(cmd["iters"]))
            elif op == "launch1":
                w.launch1()
            elif op == "calibrate":
                ans.update(w.calibrate(int(cmd.get("ws_bytes", 1 << 30))))
            elif op == "memcpy":
                ans.update(w.memcpy(int(cmd["bytes"]), int(cmd.get("repeats", 5))))
            elif op == "train":
                ans.update(w.train(int(cmd["steps"]), int(cmd.get("warmup", 20))))
            elif op == "meminfo":
                ans.update(w.meminfo())
            elif op == "ballast":
                ans["bytes"] = w.ballast_to(int(cmd["free"]))
            elif op == "exit":
                print(json.dumps({"op": "exit", "t": time.monotonic()}), flush=True)
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            ans["ok"] = True
        except Exception as exc:  # report to the harness: an OOM is a result, not a crash
            ans["ok"] = False
            ans["error"] = _describe(exc)
            if w.is_oom(exc):
                w.drop_ws()
        ans["t"] = time.monotonic()
        print(json.dumps(ans), flush=True)


def replay(path: str) -> None:
    """Play one user's cells (closed loop: each think time starts when the previous cell ends).

    The file: ``{"socket": path or "", "client": id, "horizon": s, "warm": bool,
    "chunk_bytes": the working set's allocations (0: one, see :func:`chunks`),
    "iters_per_s": matmul iterations per GPU-second, "working_set": bytes, "cells": [{"think":
    s, "gpu": s}]}``; the start of the clock (time.monotonic()) comes on stdin once every user is
    ready. Before and after each cell the user's "Jupyter" says busy / idle to the
    scheduler (what the server extension does). One JSON line per cell on stdout.
    """
    with open(path) as fh:
        spec = json.load(fh)
    client = None
    if spec.get("socket"):
        from jupyter_gpushare.scheduler_client import SchedulerClient

        client = SchedulerClient(spec["socket"])

    def control(action: str, **kwargs: Any) -> None:
        # What Jupyter's server extension sends; a refusal is reported, never fatal.
        if client is None:
            return
        try:
            client.control_sync(action, client=spec["client"], **kwargs)
        except Exception as exc:
            print(f"control {action} failed: {exc}", file=sys.stderr, flush=True)

    w = make_worker()
    if not spec.get("socket") or spec.get("warm"):
        # Plain co-location: every user makes its context first, and only when all have one
        # does anyone load data (the harness sends a line). Otherwise a late starter's context
        # could find the card already filled by the others' working sets, and fail to start:
        # not the "did not fit" a co-located user meets in its cells. A warm start (under the
        # shim) waits the same way: the harness lets the users load one at a time, in the
        # trace's order, each once the previous one's memory has settled (bench/replay.py).
        w.init_context()
        print(json.dumps({"context": True}), flush=True)
        sys.stdin.readline()
    # Before the clock starts, the user is a running notebook kernel that has loaded its data:
    # context, working set, matmul operands and library handles exist (first-use costs are
    # not cells' costs). Then it gives the device back at once, so that under an exclusive
    # lock the next user's warm-up can run. Under plain co-location an allocation that does
    # not fit fails here, and again in each cell.
    control("kernel_state", state="busy")
    chunk = int(spec.get("chunk_bytes", 0))
    if spec.get("warm"):
        # A warm start (under the shim): the memory is allocated before the first kernel, so
        # that the request carries it, as a later cell's does (the simulator's warm start).
        w.reserve(int(spec["working_set"]), chunk)
    w.launch1()
    try:
        w.alloc(int(spec["working_set"]), chunk)
        w.touch()
        w.compute(2)
    except Exception as exc:
        print(f"warm-up: {_describe(exc)}", file=sys.stderr, flush=True)
        w.drop_ws()
    control("kernel_state", state="idle")
    control("release")
    print(json.dumps({"ready": True}), flush=True)
    t0 = float(sys.stdin.readline())  # the harness starts every user's clock at once
    horizon = float(spec["horizon"])
    ready = t0
    for i, cell in enumerate(spec["cells"]):
        arrival = ready + float(cell["think"])
        if arrival - t0 > horizon:
            break
        delay = arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start = time.monotonic()
        control("kernel_state", state="busy")
        ok, error = True, ""
        try:
            w.alloc(int(spec["working_set"]), chunk)
            w.touch()
            w.compute(max(1, round(float(cell["gpu"]) * float(spec["iters_per_s"]))))
        except Exception as exc:  # out of memory (co-location), or the shim's pool refusal
            ok, error = False, _describe(exc)
            w.drop_ws()
        end = time.monotonic()
        control("kernel_state", state="idle")
        ready = end
        print(
            json.dumps(
                {
                    "cell": i,
                    "arrival": arrival - t0,
                    "start": start - t0,
                    "end": end - t0,
                    "ok": ok,
                    "error": error,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) == 3 and sys.argv[1] == "replay":
        replay(sys.argv[2])
    else:
        raise SystemExit(__doc__)
