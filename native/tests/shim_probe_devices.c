/*
 * shim_probe's scenarios of memory on two devices (issue 12, fault 3): included by shim_probe.c,
 * whose helpers they use.
 *
 *   shim_probe twomem SECONDS US BYTES0 BYTES1 FREE1_AFTER
 *       one thread per device (0 and 1), each on that device's primary context: cuMemAlloc of
 *       BYTESn, filled with a pattern of its device ({"event":"allocated","dev":N,"ptr":P}), then
 *       US-long kernels back to back for SECONDS, {"event":"launch","dev":N,"resident":[R0,R1]}
 *       after each (R: what the stand-in's devices hold of this process's). Device 1's thread
 *       checks and frees its memory after FREE1_AFTER seconds (0: at the end, like device 0's):
 *       {"event":"verified","dev":N,"ptr":P,"ok":B} then {"event":"freed","dev":N}. Both done,
 *       {"event":"done"} and two seconds more with the contexts alive (the accounting after the
 *       frees can be read meanwhile). With PROBE_STEP_DIR set (see hold_until_told), device 1
 *       frees only once the file "free1" is there too, and "done" lasts until the file "done".
 *   shim_probe twoquota BYTES
 *       BYTES on device 0, BYTES on device 1, BYTES more on device 1, each cuMemAlloc's result and
 *       cuMemGetInfo on each device in {"event":"quota",...}; then device 1's memory freed
 *       ({"event":"freed1"}), then device 0's ({"event":"freed0"}), then the end, each a second
 *       after the last, or with PROBE_STEP_DIR set once the file named after the last event is
 *       there.
 */

CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned int, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

#define PATTERN(dev) (0xC0DE0000u + (unsigned)(dev))

static unsigned long long fake_resident(int phys)
{
    unsigned long long (*f)(int) =
        (unsigned long long (*)(int))dlsym(RTLD_DEFAULT, "fakecuda_resident_bytes");
    return f ? f(phys) : 0;
}

/* Every word of [p, p+bytes) holds PATTERN(dev). In 64 MiB copies: each synchronous copy waits
 * for the stand-in's queued kernels, the other device's included. */
static int pattern_intact(CUdeviceptr p, size_t bytes, int dev)
{
    enum { CHUNK = 64 << 20 };
    unsigned int *buf = malloc(CHUNK);
    int ok = buf != NULL;
    for (size_t off = 0; ok && off < bytes; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        ok = cuMemcpyDtoH_v2(buf, p + off, n) == CUDA_SUCCESS;
        for (size_t i = 0; ok && i < n / 4; i++)
            ok = buf[i] == PATTERN(dev);
    }
    free(buf);
    return ok;
}

/* Has the test created $PROBE_STEP_DIR/STEP? (Always yes without PROBE_STEP_DIR.) */
static int told(const char *step)
{
    const char *dir = getenv("PROBE_STEP_DIR");
    if (!dir)
        return 1;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, step);
    return access(path, F_OK) == 0;
}

/* With PROBE_STEP_DIR, until the test creates STEP there (two minutes at most): the test has seen
 * the scheduler's view of what came before, which a fixed pause races on a loaded host. Without
 * it, FALLBACK seconds. */
static void hold_until_told(const char *step, double fallback)
{
    if (!getenv("PROBE_STEP_DIR")) {
        sleep_s(fallback);
        return;
    }
    for (double end = now() + 120.0; now() < end && !told(step);)
        sleep_s(0.01);
}

struct twomem_arg {
    int ordinal;
    double seconds, free_after;
    unsigned long long us;
    size_t bytes;
    int rc;
};

static void *twomem_thread(void *p)
{
    struct twomem_arg *a = p;
    a->rc = 1;
    CUstream st;
    CUdeviceptr mem = 0;
    int d = a->ordinal;
    TCHECK(d, thread_on(d, &st));
    TCHECK(d, cuMemAlloc_v2(&mem, a->bytes));
    TCHECK(d, cuMemsetD32_v2(mem, PATTERN(d), a->bytes / 4));
    emit("allocated", ",\"dev\":%d,\"ptr\":%llu,\"bytes\":%zu", d, (unsigned long long)mem,
         a->bytes);
    double t0 = now();
    for (double end = t0 + a->seconds; now() < end || mem;) {
        int free_now = a->free_after > 0 && now() - t0 >= a->free_after && told("free1");
        if (mem && (now() >= end || free_now)) {
            int ok = pattern_intact(mem, a->bytes, a->ordinal);
            emit("verified", ",\"dev\":%d,\"ptr\":%llu,\"ok\":%s", a->ordinal,
                 (unsigned long long)mem, ok ? "true" : "false");
            TCHECK(d, cuMemFree_v2(mem));
            mem = 0;
            emit("freed", ",\"dev\":%d", a->ordinal);
            continue;
        }
        TCHECK(d, launch_sleep(st, a->us));
        TCHECK(d, cuStreamSynchronize(st));
        emit("launch", ",\"dev\":%d,\"resident\":[%llu,%llu]", a->ordinal, fake_resident(0),
             fake_resident(1));
    }
    a->rc = 0;
    return NULL;
}

static int scenario_twomem(double seconds, unsigned long long us, size_t bytes0, size_t bytes1,
                           double free1_after)
{
    if (setup_on(0)) /* the module, and the session registered for device 0 */
        return 1;
    struct twomem_arg args[2] = {{0, seconds, 0, us, bytes0, 1},
                                 {1, seconds, free1_after, us, bytes1, 1}};
    pthread_t tids[2];
    for (int i = 0; i < 2; i++)
        if (pthread_create(&tids[i], NULL, twomem_thread, &args[i]) != 0)
            return 1;
    for (int i = 0; i < 2; i++)
        pthread_join(tids[i], NULL);
    emit("done", NULL);
    hold_until_told("done", 2.0);
    return args[0].rc || args[1].rc;
}

static int scenario_twoquota(size_t bytes)
{
    if (setup_on(0))
        return 1;
    CUdevice dev1;
    CUcontext ctx1;
    CHECK(cuDeviceGet(&dev1, 1));
    CHECK(cuDevicePrimaryCtxRetain(&ctx1, dev1));
    CUdeviceptr p0 = 0, p1 = 0, p2 = 0;
    size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0;
    CHECK(cuCtxSetCurrent(g_ctx));
    CUresult r0 = cuMemAlloc_v2(&p0, bytes);
    CHECK(cuMemGetInfo_v2(&free0, &total0));
    CHECK(cuCtxSetCurrent(ctx1));
    CUresult r1 = cuMemAlloc_v2(&p1, bytes);
    CUresult r2 = cuMemAlloc_v2(&p2, bytes);
    CHECK(cuMemGetInfo_v2(&free1, &total1));
    emit("quota",
         ",\"rc0\":%d,\"rc1\":%d,\"rc1_again\":%d,\"free0\":%zu,\"total0\":%zu,\"free1\":%zu,"
         "\"total1\":%zu",
         r0, r1, r2, free0, total0, free1, total1);
    hold_until_told("quota", 1.0);
    if (p2)
        CHECK(cuMemFree_v2(p2));
    if (p1)
        CHECK(cuMemFree_v2(p1));
    emit("freed1", NULL);
    hold_until_told("freed1", 1.0);
    CHECK(cuCtxSetCurrent(g_ctx));
    if (p0)
        CHECK(cuMemFree_v2(p0));
    emit("freed0", NULL);
    hold_until_told("freed0", 1.0);
    return 0;
}
