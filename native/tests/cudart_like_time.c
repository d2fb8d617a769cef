/*
 * cudart_like's scenarios over time: hold, grow, idle, the pre-copy and eviction patterns, deep
 * idle, IPC, context teardown, status, temporaries (included by cudart_like.c; not compiled
 * alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Time: hold, idle                                                                             */
/* ------------------------------------------------------------------------------------------ */

static void emit_tick(long launches) {
    char st[2048];
    status_fields(st, sizeof(st));
    emit("tick", ",\"launches\":%ld%s", launches, st);
}

/* Launch, synchronise, repeat for `seconds` after the first launch got through. */
static int hold(double seconds, unsigned long long us, long *launches_out, int report_first) {
    double start = clock_s(CLOCK_MONOTONIC), first = -1, last_tick = start;
    long launches = 0;
    for (;;) {
        double before = clock_s(CLOCK_MONOTONIC);
        CUresult rc = launch_sleep(us);
        if (rc) return fail("cuLaunchKernel(sleep)", rc);
        launches++;
        double after = clock_s(CLOCK_MONOTONIC);
        if (first < 0) {
            first = after;
            if (report_first)
                emit("first_launch", ",\"waited\":%.6f,\"call_started\":%.6f", after - start,
                     before);
        }
        rc = p_cuStreamSynchronize(work_stream());
        if (rc) return fail("cuStreamSynchronize", rc);
        double now = clock_s(CLOCK_MONOTONIC);
        if (now - last_tick >= 0.5) {
            emit_tick(launches);
            last_tick = now;
        }
        if (now - first >= seconds) break;
    }
    *launches_out = launches;
    return 0;
}

/* The stand-in's physical device memory in use (its stats' live_device_bytes), or -1. */
static long long fake_device_bytes(void) {
    int (*f)(char *, size_t) = (int (*)(char *, size_t))fake_sym("fakecuda_stats_json");
    char buf[16384];
    if (!f || f(buf, sizeof(buf)) < 0) return -1;
    const char *p = strstr(buf, "\"live_device_bytes\":");
    return p ? atoll(p + strlen("\"live_device_bytes\":")) : -1;
}

/* A scratch buffer of `temp` bytes allocated, written and freed twice while the process holds
 * the device (its block is resident when freed); the status right after says what the shim
 * reports. */
static int free_a_resident_temporary(size_t temp) {
    for (int i = 0; i < 2; i++) {
        CUdeviceptr t = 0;
        CHECK(p_cuMemAlloc(&t, temp));
        CHECK(p_cuMemsetD8(t, 3, temp));
        CHECK(p_cuMemFree(t));
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("temporary_freed", ",\"bytes\":%zu%s", temp, st);
    return 0;
}

static int scenario_hold(double seconds, size_t bytes, unsigned long long us, size_t temp) {
    CUdeviceptr d = 0;
    unsigned char *h = NULL, *g = NULL;
    size_t n = bytes < (4u << 20) ? bytes : (4u << 20);
    if (bytes) {
        CHECK(p_cuMemAlloc(&d, bytes));
        h = malloc(n);
        g = malloc(n);
        if (!h || !g) return 1;
        for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31 + 1);
        char st[2048];
        status_fields(st, sizeof(st));
        emit("allocated", ",\"bytes\":%zu,\"device_bytes\":%lld%s", bytes, fake_device_bytes(),
             st);
    }
    emit("hold_start", ",\"seconds\":%.3f,\"bytes\":%zu,\"kernel_us\":%llu", seconds, bytes, us);
    long launches = 0;
    if (bytes) {
        /* The first GPU call of the turn is this copy: it is what waits for the device. */
        double t0 = clock_s(CLOCK_MONOTONIC);
        CHECK(p_cuMemsetD8(d, 0, bytes));
        CHECK(p_cuMemcpyHtoD(d, h, n));
        double waited = clock_s(CLOCK_MONOTONIC) - t0;
        char st[2048];
        status_fields(st, sizeof(st));
        emit("first_copy", ",\"waited\":%.6f,\"device_bytes\":%lld%s", waited,
             fake_device_bytes(), st);
    }
    if (temp && free_a_resident_temporary(temp)) return 1;
    if (hold(seconds, us, &launches, 1)) return 1;
    int ok = 1;
    if (bytes) {
        CHECK(p_cuMemcpyDtoH(g, d, n));
        ok = memcmp(g, h, n) == 0;
        CHECK(p_cuMemFree(d));
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("hold_end", ",\"launches\":%ld,\"data_ok\":%s%s", launches, ok ? "true" : "false", st);
    free(h);
    free(g);
    return !ok;
}

/* Issue 21 item 2, memory past the grant's room: the device is granted for a small first cell
 * (beside another kernel that holds most of the pool), then BYTES are allocated, more than the
 * grant's room. The allocation succeeds; a thread reports the status while the first copy into
 * the new memory waits for a grant with room ("blocked", half a second in); then the memory is
 * written, held HOLD seconds and read back. */
static void *report_blocked(void *arg) {
    (void)arg;
    sleep_s(0.5);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("blocked", ",\"device_bytes\":%lld%s", fake_device_bytes(), st);
    return NULL;
}

static int scenario_grow(double first_s, size_t bytes, double hold_s) {
    long launches = 0;
    if (hold(first_s, 20000, &launches, 0)) return 1;
    char st[2048];
    status_fields(st, sizeof(st));
    emit("granted", ",\"launches\":%ld,\"device_bytes\":%lld%s", launches, fake_device_bytes(),
         st);
    /* PROBE_GROW_AFTER: a file the test makes once the kernel beside has its memory. */
    const char *after = getenv("PROBE_GROW_AFTER");
    while (after && *after && access(after, F_OK) != 0) sleep_s(0.02);
    CUdeviceptr d = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    status_fields(st, sizeof(st));
    emit("allocated", ",\"bytes\":%zu,\"device_bytes\":%lld%s", bytes, fake_device_bytes(), st);
    size_t n = bytes < (4u << 20) ? bytes : (4u << 20);
    unsigned char *h = malloc(n), *g = malloc(n);
    if (!h || !g) return 1;
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31 + 7);
    pthread_t reporter;
    if (pthread_create(&reporter, NULL, report_blocked, NULL) != 0) return 1;
    double t0 = clock_s(CLOCK_MONOTONIC);
    CHECK(p_cuMemsetD8(d, 0, bytes));
    CHECK(p_cuMemcpyHtoD(d, h, n));
    double waited = clock_s(CLOCK_MONOTONIC) - t0;
    pthread_join(reporter, NULL);
    status_fields(st, sizeof(st));
    emit("first_copy", ",\"waited\":%.6f,\"device_bytes\":%lld%s", waited, fake_device_bytes(),
         st);
    if (hold(hold_s, 20000, &launches, 0)) return 1;
    CHECK(p_cuMemcpyDtoH(g, d, n));
    int ok = memcmp(g, h, n) == 0;
    CHECK(p_cuMemFree(d));
    emit("hold_end", ",\"launches\":%ld,\"data_ok\":%s", launches, ok ? "true" : "false");
    free(h);
    free(g);
    return !ok;
}

/* The device is granted before any cudaMalloc (a program whose first memory comes from its own
 * allocator, as PyTorch's expandable segments), then cudaMalloc'd memory must be usable at once:
 * a grant made before the engine's first block must not leave later blocks unbacked. */
static int scenario_late_alloc(size_t size) {
    long launches = 0;
    if (hold(0.2, 20000, &launches, 0)) return 1;
    emit("granted", ",\"launches\":%ld,\"device_bytes\":%lld", launches, fake_device_bytes());
    return scenario_alloc(P_ALLOC, size);
}

static int scenario_idle(double seconds, double hold_s, size_t bytes) {
    long launches = 0;
    CUdeviceptr d = 0;
    if (bytes) {
        CHECK(p_cuMemAlloc(&d, bytes));
        emit("allocated", ",\"bytes\":%zu", bytes);
    }
    emit("hold_start", ",\"seconds\":%.3f", hold_s);
    if (bytes) CHECK(p_cuMemsetD8(d, 7, bytes));
    if (hold(hold_s, 20000, &launches, 1)) return 1;
    emit("idle_start", ",\"launches\":%ld", launches);
    double start = clock_s(CLOCK_MONOTONIC);
    while (clock_s(CLOCK_MONOTONIC) - start < seconds) {
        sleep_s(0.25);
        emit_tick(launches);
    }
    emit_status("idle_end");
    if (bytes) CHECK(p_cuMemFree(d));
    return 0;
}

static void fill_pattern(unsigned char *h, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31 + seed);
}

/* Write pattern `seed` to BYTES at d (all of it; the first n bytes from h). */
static CUresult write_pattern(CUdeviceptr d, size_t bytes, unsigned char *h, size_t n, unsigned seed) {
    fill_pattern(h, n, seed);
    CUresult rc = p_cuMemsetD8(d, (unsigned char)seed, bytes);
    return rc != CUDA_SUCCESS ? rc : p_cuMemcpyHtoD(d, h, n);
}

/* No GPU calls for `seconds` after the event `name`, a status tick every 0.1 s. */
static void idle_ticking(const char *name, double seconds, long launches) {
    emit(name, ",\"launches\":%ld", launches);
    for (double t0 = clock_s(CLOCK_MONOTONIC); clock_s(CLOCK_MONOTONIC) - t0 < seconds;) {
        sleep_s(0.1);
        emit_tick(launches);
    }
}

/* Whether BYTES at d hold pattern `seed` (the first n bytes as in h, the last byte too). */
static int pattern_ok(CUdeviceptr d, size_t bytes, const unsigned char *h, unsigned char *g,
                      size_t n, unsigned seed) {
    unsigned char last = 0;
    if (p_cuMemcpyDtoH(g, d, n) != CUDA_SUCCESS) return 0;
    if (p_cuMemcpyDtoH(&last, d + bytes - 1, 1) != CUDA_SUCCESS) return 0;
    return memcmp(g, h, n) == 0 && (bytes <= n || last == (unsigned char)seed);
}

/* BYTES of device memory holding pattern 1, with host buffers to check it (the first n bytes). */
struct patterned {
    size_t bytes, n;
    unsigned char *h, *g;
    CUdeviceptr d;
};

static CUresult patterned_alloc(struct patterned *p, size_t bytes) {
    p->bytes = bytes;
    p->n = bytes < (4u << 20) ? bytes : (4u << 20);
    p->h = malloc(p->n);
    p->g = malloc(p->n);
    p->d = 0;
    if (!p->h || !p->g || !bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = p_cuMemAlloc(&p->d, bytes);
    return rc != CUDA_SUCCESS ? rc : write_pattern(p->d, bytes, p->h, p->n, 1);
}

static int patterned_free(struct patterned *p, int ok) {
    CHECK(p_cuMemFree(p->d));
    free(p->h);
    free(p->g);
    return !ok;
}

/* Pre-copy and its invalidation (tests/native/test_memory_engine.py): the data written after
 * a pre-copy must be what comes back after an eviction. */
static int scenario_precopy_cycle(size_t bytes, double idle1, double hold2, double idle2) {
    struct patterned p;
    long launches = 0;
    CHECK(patterned_alloc(&p, bytes));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    idle_ticking("idle1_start", idle1, launches);
    CHECK(write_pattern(p.d, bytes, p.h, p.n, 2));
    emit_status("written2");
    if (hold(hold2, 20000, &launches, 0)) return 1;
    idle_ticking("idle2_start", idle2, launches);
    int ok = pattern_ok(p.d, bytes, p.h, p.g, p.n, 2);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("cycle_end", ",\"data_ok\":%s%s", ok ? "true" : "false", st);
    return patterned_free(&p, ok);
}

/* A write still queued when the kernel goes idle (tests/native/test_memory_engine.py): pattern 2
 * is copied over pattern 1 on the program's own non-blocking stream and never waited for, as a
 * cell that returns once its work is launched. The scheduler asks for a pre-copy at the idle and
 * an arrival evicts the kernel; after the next grant the data must be pattern 2. */
static int scenario_precopy_pending(size_t bytes, double idle) {
    struct patterned p;
    long launches = 0;
    unsigned char *next = malloc(bytes);
    if (!next) return 1;
    CHECK(patterned_alloc(&p, bytes));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    memset(next, 2, bytes);
    fill_pattern(next, p.n, 2);
    CHECK(p_cuMemcpyHtoDAsync(p.d, next, bytes, NULL));
    idle_ticking("idle_start", idle, launches);
    fill_pattern(p.h, p.n, 2);
    int ok = pattern_ok(p.d, bytes, p.h, p.g, p.n, 2);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("pending_end", ",\"data_ok\":%s%s", ok ? "true" : "false", st);
    free(next);
    return patterned_free(&p, ok);
}

/* Several blocks, each its own pattern (tests/native/test_partial_eviction.py): allocated in
 * order, used, then idle while the scheduler evicts part of them; every block's data is checked
 * after the next grant. */
static int scenario_blocks(int k, size_t bytes, double idle) {
    CUdeviceptr d[16];
    unsigned char *h = malloc(4u << 20), *g = malloc(4u << 20);
    size_t n = bytes < (4u << 20) ? bytes : (4u << 20);
    long launches = 0;
    if (k < 1 || k > 16 || !h || !g) return 1;
    for (int i = 0; i < k; i++) CHECK(p_cuMemAlloc(&d[i], bytes));
    emit_status("allocated"); /* before the first gated call: it may wait for the device */
    for (int i = 0; i < k; i++) CHECK(write_pattern(d[i], bytes, h, n, (unsigned)i + 1));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    idle_ticking("idle_start", idle, launches);
    int ok = 1;
    for (int i = 0; i < k; i++) {
        fill_pattern(h, n, (unsigned)i + 1);
        ok &= pattern_ok(d[i], bytes, h, g, n, (unsigned)i + 1);
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("blocks_end", ",\"data_ok\":%s%s", ok ? "true" : "false", st);
    /* PROBE_BLOCKS_KEEP_UNTIL: a file the test makes once it has seen what the shim does with
     * the blocks back on the device (tests/native/test_staging_allowance.py); they stay until
     * then, 60 s at most, instead of racing the shim's own work with the frees. */
    const char *keep = getenv("PROBE_BLOCKS_KEEP_UNTIL");
    for (double t0 = clock_s(CLOCK_MONOTONIC);
         keep && *keep && access(keep, F_OK) != 0 && clock_s(CLOCK_MONOTONIC) - t0 < 60;)
        sleep_s(0.02);
    for (int i = 0; i < k; i++) CHECK(p_cuMemFree(d[i]));
    free(h);
    free(g);
    return !ok;
}

/* A burst of allocations (tests/native/test_cold_eviction.py): k blocks, one every `every`
 * seconds, no GPU call between them; the status at the burst's end says how much staging is
 * ready. */
static int scenario_burst(int k, size_t bytes, double every) {
    CUdeviceptr d[64];
    if (k < 1 || k > 64) return 1;
    for (int i = 0; i < k; i++) {
        CHECK(p_cuMemAlloc(&d[i], bytes));
        sleep_s(every);
    }
    emit_status("burst_end");
    for (int i = 0; i < k; i++) CHECK(p_cuMemFree(d[i]));
    return 0;
}

/* Deep idle (tests/native/test_deep_idle.py): the first call after a long idle wakes the
 * process; the data written before must be intact. */
static int scenario_deep_idle(size_t bytes, double idle) {
    struct patterned p;
    long launches = 0;
    CHECK(patterned_alloc(&p, bytes));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    idle_ticking("idle_start", idle, launches);
    double t0 = clock_s(CLOCK_MONOTONIC);
    int ok = pattern_ok(p.d, bytes, p.h, p.g, p.n, 1);
    double first = clock_s(CLOCK_MONOTONIC) - t0;
    char st[2048];
    status_fields(st, sizeof(st));
    emit("woken", ",\"first_call_s\":%.6f,\"data_ok\":%s%s", first, ok ? "true" : "false", st);
    return patterned_free(&p, ok);
}

static int scenario_ipc(int path) {
    struct allocation a;
    CHECK(do_alloc(path, 1u << 20, &a));
    CUipcMemHandle h;
    CUresult rc = p_cuIpcGetMemHandle(&h, a.ptr);
    emit("ipc", ",\"path\":\"%s\",\"rc\":%d", path_names[path], rc);
    CHECK(do_free(&a));
    return 0;
}

static int usage(void);

static unsigned long long status_pinned(void) {
    char st[2048];
    status_fields(st, sizeof(st));
    const char *p = strstr(st, "\"pinned_bytes\":");
    return p ? strtoull(p + 15, NULL, 10) : 0;
}

static int scenario_ipc_export(size_t bytes, double seconds, size_t extra) {
    CUdeviceptr d, e = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    if (extra) CHECK(p_cuMemAlloc(&e, extra));
    CHECK(p_cuMemsetD8(d, 0x11, bytes));
    CUipcMemHandle h;
    CUresult rc = p_cuIpcGetMemHandle(&h, d);
    char hex[2 * sizeof h + 1];
    for (size_t i = 0; i < sizeof h; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)h.reserved[i]);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("ipc_handle", ",\"rc\":%d,\"handle\":\"%s\"%s", rc, hex, st);
    if (rc != CUDA_SUCCESS) return 1;
    unsigned char last = 0;
    double t0 = clock_s(CLOCK_MONOTONIC);
    while (last != 0x22 && clock_s(CLOCK_MONOTONIC) - t0 < seconds) {
        CHECK(p_cuMemcpyDtoH(&last, d + bytes - 1, 1));
        if (last != 0x22) sleep_s(0.05);
    }
    unsigned long long pinned = status_pinned();
    status_fields(st, sizeof(st));
    emit("ipc_seen", ",\"last\":%u%s", last, st);
    while (status_pinned() >= pinned && clock_s(CLOCK_MONOTONIC) - t0 < seconds) sleep_s(0.05);
    emit_status("ipc_released");
    unsigned char first = 0;
    CHECK(p_cuMemcpyDtoH(&first, d, 1));
    CHECK(p_cuMemFree(d));
    if (extra) CHECK(p_cuMemFree(e));
    if (first != 0x11) return 1;
    emit_status("ipc_freed");
    return last == 0x22 ? 0 : 1;
}

static int scenario_ipc_import(const char *hex, size_t size, double seconds) {
    CUipcMemHandle h;
    if (strlen(hex) != 2 * sizeof h) return usage();
    for (size_t i = 0; i < sizeof h; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        h.reserved[i] = (char)v;
    }
    CUdeviceptr d = 0;
    CUresult rc = p_cuIpcOpenMemHandle(&d, h, 1);
    emit("ipc_open", ",\"rc\":%d", rc);
    if (rc != CUDA_SUCCESS) return 1;
    unsigned char first = 0;
    CHECK(p_cuMemcpyDtoH(&first, d, 1));
    CHECK(p_cuMemsetD8(d + size - 1, 0x22, 1));
    emit("ipc_opened", ",\"first\":%u,\"size\":%zu", first, size);
    sleep_s(seconds);
    rc = p_cuIpcCloseMemHandle(d);
    emit("ipc_closed", ",\"rc\":%d", rc);
    return first == 0x11 && rc == CUDA_SUCCESS ? 0 : 1;
}

static int scenario_ctx_teardown(size_t bytes) {
    CUcontext own = NULL;
    char st[2048];
    CHECK(p_cuCtxCreate(&own, NULL, 0, g_dev)); /* the 12.5+ entry point (default version) */
    CHECK(p_cuCtxSetCurrent(own));
    struct allocation a[3];
    int paths[3] = {P_ALLOC, P_MANAGED, P_CREATE};
    for (int i = 0; i < 3; i++) CHECK(do_alloc(paths[i], bytes, &a[i]));
    status_fields(st, sizeof(st));
    emit("allocated", "%s", st);
    CHECK(p_cuCtxDestroy(own)); /* the program never frees: the context takes it all */
    CHECK(p_cuCtxSetCurrent(g_ctx));
    status_fields(st, sizeof(st));
    emit("destroyed", "%s", st);
    struct allocation again;
    CUresult rc = do_alloc(P_ALLOC, bytes, &again);
    if (rc == CUDA_SUCCESS) rc = round_trip(again.ptr, again.size) ? do_free(&again) : 1;
    status_fields(st, sizeof(st));
    emit("again", ",\"rc\":%d%s", rc, st);
    return rc != CUDA_SUCCESS;
}

static int scenario_status(size_t bytes) {
    CUdeviceptr d = 0;
    if (bytes) CHECK(p_cuMemAlloc(&d, bytes));
    CHECK(launch_sleep(1000));
    CHECK(p_cuStreamSynchronize(work_stream()));
    const char *(*version)(void) = (const char *(*)(void))dlsym(RTLD_DEFAULT, "gpushare_version");
    fn_status *f = status_fn();
    struct gpushare_status st;
    int small_rc = f ? f(&st, 8) : 0;
    int null_rc = f ? f(NULL, sizeof(st)) : 0;
    char buf[2048];
    status_fields(buf, sizeof(buf));
    emit("status", ",\"library_version\":%s%s%s,\"sizeof\":%zu,\"small_rc\":%d,\"null_rc\":%d%s",
         version ? "\"" : "", version ? version() : "null", version ? "\"" : "", sizeof(st), small_rc,
         null_rc, buf);
    if (d) CHECK(p_cuMemFree(d));
    return 0;
}

/* A temporary: allocated, freed LIVE seconds later while the shim may still be preparing its
 * host staging in the background; the status SETTLE seconds after says whether that staging was
 * released. A negative LIVE keeps it until the shim has registered host memory with the driver
 * (its staging made), -LIVE seconds at most: a fixed time races the preparer on a loaded host. */
static int scenario_temporary(size_t bytes, double live, double settle) {
    CUdeviceptr d = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    if (live >= 0) {
        sleep_s(live);
    } else {
        for (double end = clock_s(CLOCK_MONOTONIC) - live;
             fake_count("cuMemHostRegister_v2") < 1 && clock_s(CLOCK_MONOTONIC) < end;)
            sleep_s(0.01);
    }
    CHECK(p_cuMemFree(d));
    sleep_s(settle);
    char buf[2048];
    status_fields(buf, sizeof(buf));
    emit("temporary", ",\"bytes\":%zu%s", bytes, buf);
    return 0;
}

/* Memory freed while a revoke is answered (tests/native/test_pool_accounting.py): BYTES
 * allocated and written (the first GPU call waits for the grant), "written" said; once the file
 * PROBE_FREE_AFTER exists, a kernel of WORK seconds is launched, "freeing" said and the memory
 * freed. cuMemFree synchronises first, so the free lasts until the kernel ends, and a revoke that
 * comes meanwhile is answered after it: its eviction finds nothing left to move. The process
 * then stays connected LINGER seconds. */
static int scenario_free_in_turn(size_t bytes, double work_s, double linger_s) {
    CUdeviceptr d = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    CHECK(p_cuMemsetD8(d, 1, bytes));
    char st[2048];
    status_fields(st, sizeof(st));
    emit("written", ",\"bytes\":%zu%s", bytes, st);
    const char *after = getenv("PROBE_FREE_AFTER");
    while (after && *after && access(after, F_OK) != 0) sleep_s(0.02);
    CUresult rc = launch_sleep((unsigned long long)(work_s * 1e6));
    if (rc) return fail("cuLaunchKernel(sleep)", rc);
    status_fields(st, sizeof(st));
    emit("freeing", ",\"bytes\":%zu%s", bytes, st);
    CHECK(p_cuMemFree(d));
    status_fields(st, sizeof(st));
    emit("freed", "%s", st);
    sleep_s(linger_s);
    return 0;
}
