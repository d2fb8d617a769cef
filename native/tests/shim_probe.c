/*
 * A test program for the faults of issue 12, linked against the stand-in driver (the exported
 * door) and run under the shim. One JSON object per line, as cudart_like prints them; the last
 * line is {"event":"exit","rc":N}.
 *
 *   shim_probe launchpaths        every launch path and stream memory operation added to the gate,
 *                                 with the status API's gated_calls and the stand-in's call count
 *                                 of that exact symbol around each call
 *   shim_probe capture SECONDS MS [BYTES]
 *                                 capture a graph over and over for SECONDS (each capture stays
 *                                 open MS milliseconds), with ordinary launches between captures,
 *                                 holding BYTES of managed memory; it stops early once the file
 *                                 named by PROBE_STOP_FILE exists (the test has seen enough turns)
 *   shim_probe longcapture SECONDS BYTES
 *                                 hold BYTES, then keep one capture open for SECONDS (a capture
 *                                 that outlives the shim's bounded wait), then launch once more
 *   shim_probe launches SECONDS US [BYTES]
 *                                 launch "sleep" kernels of US microseconds back to back, holding
 *                                 BYTES of memory
 *   shim_probe grantedlaunches SECONDS US [BYTES]
 *                                 the same, SECONDS counted from the first launch's end (once the
 *                                 gate let it through), not from the start
 *   shim_probe twoctx US          contexts on devices 0 and 1; a US-long kernel on device 1's
 *                                 context, then gpushare_release(): how long the release took
 *   shim_probe twodev SECONDS US BYTES
 *                                 one thread per device (0 and 1), each on that device's primary
 *                                 context: BYTES allocated, then US-long kernels back to back for
 *                                 SECONDS, an event {"event":"launch","dev":N,"state":S} after
 *                                 each (S: the status API's state then)
 *   shim_probe otherdev N         N no-op launches on device 0 (held) timed, before and after a
 *                                 context on device 1 (not held) exists: the cost of a call on a
 *                                 held device while another device of the process is not held
 *   shim_probe reset              alloc, wait for a revoke, cuDevicePrimaryCtxReset, retain again,
 *                                 alloc, wait for a second revoke: the shim's RELEASED verdicts
 *   shim_probe ptds US QUIET      a US-long kernel on the per-thread default stream, then QUIET
 *                                 seconds without a call
 *   shim_probe streams N US       N streams; a US-long kernel on the first, a no-op on the others
 *   shim_probe once               one no-op launch, as soon as the gate lets it through
 *   shim_probe evicted MANAGED PINNED SECONDS
 *                                 hold MANAGED bytes of managed memory and PINNED of pool memory;
 *                                 launch a kernel every 50 ms for SECONDS
 *   shim_probe twomem ... / twoquota ...
 *                                 memory on two devices: see shim_probe_devices.c
 */
#include "base/cuda_abi.h"
#include "gpushare.h"
#include "probe_events.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct CUmod_st *CUmodule;

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);
CUresult cuStreamBeginCapture_v2(CUstream, CUstreamCaptureMode);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuLaunch(CUfunction);
CUresult cuLaunchGrid(CUfunction, int, int);
CUresult cuLaunchGridAsync(CUfunction, int, int, CUstream);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *, unsigned int, unsigned int);
#define DECL_OP(base, ...)                                                                        \
    CUresult base(__VA_ARGS__);                                                                   \
    CUresult base##_ptsz(__VA_ARGS__);                                                            \
    CUresult base##_v2(__VA_ARGS__);                                                              \
    CUresult base##_v2_ptsz(__VA_ARGS__);
DECL_OP(cuStreamBatchMemOp, CUstream, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
DECL_OP(cuStreamWriteValue32, CUstream, CUdeviceptr, cuuint32_t, unsigned int)
DECL_OP(cuStreamWriteValue64, CUstream, CUdeviceptr, cuuint64_t, unsigned int)
DECL_OP(cuStreamWaitValue32, CUstream, CUdeviceptr, cuuint32_t, unsigned int)
DECL_OP(cuStreamWaitValue64, CUstream, CUdeviceptr, cuuint64_t, unsigned int)

#define CHECK(call)                                                                               \
    do {                                                                                          \
        CUresult r_ = (call);                                                                     \
        if (r_ != CUDA_SUCCESS) {                                                                 \
            emit("error", ",\"call\":\"%s\",\"rc\":%d", #call, r_);                               \
            return 1;                                                                             \
        }                                                                                         \
    } while (0)

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static int status(struct gpushare_status *st)
{
    int (*get)(struct gpushare_status *, size_t) =
        (int (*)(struct gpushare_status *, size_t))dlsym(RTLD_DEFAULT, "gpushare_get_status");
    memset(st, 0, sizeof *st);
    return get ? get(st, sizeof *st) : -1;
}

static uint64_t gated_calls(void)
{
    struct gpushare_status st;
    return status(&st) == 0 ? st.gated_calls : 0;
}

static unsigned long fake_count(const char *name)
{
    unsigned long (*f)(const char *) =
        (unsigned long (*)(const char *))dlsym(RTLD_DEFAULT, "fakecuda_call_count");
    return f ? f(name) : 0;
}

static CUcontext g_ctx;
static CUstream g_stream;
static CUfunction g_sleep, g_noop;

static int setup_on(int ordinal)
{
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, ordinal));
    CHECK(cuDevicePrimaryCtxRetain(&g_ctx, dev));
    CHECK(cuCtxSetCurrent(g_ctx));
    CHECK(cuStreamCreate(&g_stream, 0));
    CUmodule mod;
    CHECK(cuModuleLoadData(&mod, "fake module image"));
    CHECK(cuModuleGetFunction(&g_sleep, mod, "sleep"));
    CHECK(cuModuleGetFunction(&g_noop, mod, "noop"));
    return 0;
}

static CUresult launch_sleep(CUstream s, unsigned long long us)
{
    void *params[] = {&us};
    return cuLaunchKernel(g_sleep, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
}

static CUresult launch_noop(CUstream s)
{
    return cuLaunchKernel(g_noop, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
}

/* ---- launchpaths ---- */

static int scenario_launchpaths(void)
{
    if (setup_on(0))
        return 1;
    CHECK(launch_noop(g_stream)); /* the session starts; the gate opens */
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 4096));
    char params[64];
    int all_ok = 1;
#define PATH(name, call)                                                                          \
    do {                                                                                          \
        uint64_t g0 = gated_calls();                                                              \
        unsigned long f0 = fake_count(#name);                                                     \
        CUresult rc_ = (call);                                                                    \
        uint64_t dg = gated_calls() - g0;                                                         \
        unsigned long df = fake_count(#name) - f0;                                                \
        all_ok &= rc_ == CUDA_SUCCESS && dg == 1 && df == 1;                                      \
        emit("path", ",\"name\":\"%s\",\"rc\":%d,\"gated_delta\":%llu,\"driver_delta\":%lu",     \
             #name, rc_, (unsigned long long)dg, df);                                             \
    } while (0)
    PATH(cuLaunch, cuLaunch(g_noop));
    PATH(cuLaunchGrid, cuLaunchGrid(g_noop, 1, 1));
    PATH(cuLaunchGridAsync, cuLaunchGridAsync(g_noop, 1, 1, g_stream));
    PATH(cuLaunchCooperativeKernelMultiDevice,
         cuLaunchCooperativeKernelMultiDevice((CUDA_LAUNCH_PARAMS *)params, 1, 0));
#define OPS(base, ...)                                                                            \
    PATH(base, base(__VA_ARGS__));                                                                \
    PATH(base##_ptsz, base##_ptsz(__VA_ARGS__));                                                  \
    PATH(base##_v2, base##_v2(__VA_ARGS__));                                                      \
    PATH(base##_v2_ptsz, base##_v2_ptsz(__VA_ARGS__));
    OPS(cuStreamBatchMemOp, g_stream, 1, (CUstreamBatchMemOpParams *)params, 0)
    OPS(cuStreamWriteValue32, g_stream, p, 1, 0)
    OPS(cuStreamWriteValue64, g_stream, p, 1, 0)
    OPS(cuStreamWaitValue32, g_stream, p, 1, 0)
    OPS(cuStreamWaitValue64, g_stream, p, 1, 0)
    emit("paths", ",\"ok\":%s", all_ok ? "true" : "false");
    return 0;
}

/* ---- capture ---- */

static int scenario_capture(double seconds, double capture_ms, size_t bytes)
{
    if (setup_on(0))
        return 1;
    CUdeviceptr p;
    if (bytes)
        CHECK(cuMemAlloc_v2(&p, bytes));
    CUstream s;
    CHECK(cuStreamCreate(&s, 0));
    int ok = 0, failed = 0, launch_failed = 0;
    double longest = 0; /* the longest capture, begin to end, in seconds */
    double end = now() + seconds;
    const char *stop = getenv("PROBE_STOP_FILE");
    while (now() < end && !(stop && access(stop, F_OK) == 0)) {
        /* Ordinary work between captures: the process wants the device, so revokes come. */
        launch_failed += launch_sleep(s, 2000) != CUDA_SUCCESS;
        CHECK(cuStreamSynchronize(s));
        double began = now();
        CHECK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < 4; i++) {
            launch_failed += launch_noop(s) != CUDA_SUCCESS;
            sleep_s(capture_ms / 4000.0);
        }
        CUgraph g = NULL;
        CUresult r = cuStreamEndCapture(s, &g);
        if (now() - began > longest)
            longest = now() - began;
        if (r == CUDA_SUCCESS && g)
            ok++;
        else
            failed++;
    }
    emit("captures", ",\"ok\":%d,\"failed\":%d,\"launch_failed\":%d,\"longest_ms\":%.1f", ok,
         failed, launch_failed, longest * 1000.0);
    return 0;
}

/* ---- longcapture ---- */

static int scenario_longcapture(double seconds, size_t bytes)
{
    if (setup_on(0))
        return 1;
    CUdeviceptr p;
    CUstream s;
    CHECK(cuMemAlloc_v2(&p, bytes));
    CHECK(cuStreamCreate(&s, 0));
    CHECK(launch_noop(s)); /* holding the device */
    CHECK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    emit("capturing", NULL);
    for (double end = now() + seconds; now() < end; sleep_s(0.05))
        CHECK(launch_noop(s)); /* captured: passes whatever the gate says */
    CUgraph g = NULL;
    CUresult r = cuStreamEndCapture(s, &g);
    emit("captured", ",\"rc\":%d", r);
    CHECK(launch_noop(s)); /* ordinary work again: it waits for the device */
    emit("ran", NULL);
    return 0;
}

/* ---- launches ---- */

static int scenario_launches(double seconds, unsigned long long us, size_t bytes, int from_grant)
{
    if (setup_on(0))
        return 1;
    CUdeviceptr p;
    if (bytes)
        CHECK(cuMemAlloc_v2(&p, bytes));
    int n = 0;
    if (from_grant) {
        CHECK(launch_sleep(g_stream, us));
        CHECK(cuStreamSynchronize(g_stream));
        n++;
    }
    for (double end = now() + seconds; now() < end; n++) {
        CHECK(launch_sleep(g_stream, us));
        CHECK(cuStreamSynchronize(g_stream)); /* one at a time: the queue never runs ahead */
    }
    emit("launches", ",\"n\":%d", n);
    return 0;
}

/* ---- twoctx ---- */

static int scenario_twoctx(unsigned long long us)
{
    if (setup_on(0))
        return 1;
    CHECK(launch_noop(g_stream)); /* registered and holding, on device 0's primary context */
    CUdevice dev1;
    CUcontext ctx1;
    CUstream s1;
    CHECK(cuDeviceGet(&dev1, 1));
    CHECK(cuCtxCreate_v2(&ctx1, 0, dev1)); /* current now */
    CHECK(cuStreamCreate(&s1, 0));
    CHECK(launch_sleep(s1, us));
    double t0 = now();
    int (*release)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "gpushare_release");
    int rc = release ? release() : -2;
    emit("released", ",\"rc\":%d,\"seconds\":%.6f,\"kernel_seconds\":%.6f", rc, now() - t0,
         us / 1e6);
    return 0;
}

/* ---- twodev ---- */

/* In a thread of its own: an error names the device. */
#define TCHECK(ordinal, call)                                                                     \
    do {                                                                                          \
        CUresult r_ = (call);                                                                     \
        if (r_ != CUDA_SUCCESS) {                                                                 \
            emit("error", ",\"dev\":%d,\"call\":\"%s\",\"rc\":%d", (ordinal), #call, r_);          \
            return NULL;                                                                          \
        }                                                                                         \
    } while (0)

/* This thread on device `ordinal`'s primary context, with a stream of its own. */
static CUresult thread_on(int ordinal, CUstream *st)
{
    CUdevice dev;
    CUcontext ctx;
    CUresult r = cuDeviceGet(&dev, ordinal);
    if (r == CUDA_SUCCESS)
        r = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (r == CUDA_SUCCESS)
        r = cuCtxSetCurrent(ctx);
    return r == CUDA_SUCCESS ? cuStreamCreate(st, 0) : r;
}

struct twodev_arg {
    int ordinal;
    double seconds;
    unsigned long long us;
    size_t bytes;
    int rc;
};

static void *twodev_thread(void *p)
{
    struct twodev_arg *a = p;
    a->rc = 1;
    CUstream st;
    CUdeviceptr mem;
    TCHECK(a->ordinal, thread_on(a->ordinal, &st));
    if (a->bytes)
        TCHECK(a->ordinal, cuMemAlloc_v2(&mem, a->bytes));
    for (double end = now() + a->seconds; now() < end;) {
        TCHECK(a->ordinal, launch_sleep(st, a->us));
        struct gpushare_status s;
        emit("launch", ",\"dev\":%d,\"state\":%d", a->ordinal,
             status(&s) == 0 ? (int)s.state : -1);
        TCHECK(a->ordinal, cuStreamSynchronize(st));
    }
    a->rc = 0;
    return NULL;
}

static int scenario_twodev(double seconds, unsigned long long us, size_t bytes)
{
    if (setup_on(0)) /* the module, and the session registered for device 0 */
        return 1;
    struct twodev_arg args[2] = {{0, seconds, us, bytes, 1}, {1, seconds, us, bytes, 1}};
    pthread_t tids[2];
    for (int i = 0; i < 2; i++)
        if (pthread_create(&tids[i], NULL, twodev_thread, &args[i]) != 0)
            return 1;
    for (int i = 0; i < 2; i++)
        pthread_join(tids[i], NULL);
    return args[0].rc || args[1].rc;
}

/* ---- otherdev ---- */

static double time_noops(int n)
{
    double t0 = now();
    for (int i = 0; i < n; i++)
        if (launch_noop(g_stream) != CUDA_SUCCESS)
            return -1;
    double dt = now() - t0;
    cuStreamSynchronize(g_stream);
    return dt / n * 1e9;
}

static int scenario_otherdev(int n)
{
    if (setup_on(0))
        return 1;
    CHECK(launch_noop(g_stream)); /* device 0 granted */
    double alone = time_noops(n);
    CUdevice dev1;
    CUcontext ctx1;
    CHECK(cuDeviceGet(&dev1, 1));
    CHECK(cuDevicePrimaryCtxRetain(&ctx1, dev1)); /* device 1 registered, never asked for */
    CHECK(cuCtxSetCurrent(g_ctx));
    double with_other = time_noops(n);
    emit("otherdev", ",\"n\":%d,\"ns_alone\":%.1f,\"ns_other_not_held\":%.1f", n, alone,
         with_other);
    return 0;
}

/* ---- reset ---- */

/* Until the device was given back: the release has ended (a state of RELEASING is the shim still
 * draining and evicting; resetting the context then raced the eviction's last step and failed
 * it, seen on the loaded stand-in host). */
static int wait_not_holding(double timeout)
{
    struct gpushare_status st;
    for (double end = now() + timeout; now() < end; sleep_s(0.01))
        if (status(&st) == 0 && st.state != GPUSHARE_STATE_HOLDING &&
            st.state != GPUSHARE_STATE_RELEASING)
            return 0;
    return -1;
}

static int scenario_reset(void)
{
    if (setup_on(0))
        return 1;
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 64 << 20));
    CHECK(launch_noop(g_stream));
    emit("ready", ",\"step\":1");
    if (wait_not_holding(30))
        return 1;
    CUdevice dev;
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxReset_v2(dev));
    if (setup_on(0))
        return 1;
    CHECK(cuMemAlloc_v2(&p, 64 << 20));
    CHECK(launch_noop(g_stream));
    emit("ready", ",\"step\":2");
    if (wait_not_holding(30))
        return 1;
    emit("done", NULL);
    return 0;
}

/* ---- ptds ---- */

static int scenario_ptds(unsigned long long us, double quiet)
{
    if (setup_on(0))
        return 1;
    unsigned long long arg = us;
    void *params[] = {&arg};
    CHECK(cuLaunchKernel_ptsz(g_sleep, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
    double t = now();
    emit("launched", ",\"busy_until\":%.6f", t + us / 1e6);
    sleep_s(quiet);
    return 0;
}

/* ---- streams ---- */

static int scenario_streams(int n, unsigned long long us, double quiet)
{
    if (setup_on(0))
        return 1;
    CUstream *s = calloc((size_t)n, sizeof *s);
    for (int i = 0; i < n; i++)
        CHECK(cuStreamCreate(&s[i], 0));
    CHECK(launch_sleep(s[0], us));
    double t = now();
    for (int i = 1; i < n; i++)
        CHECK(launch_noop(s[i]));
    emit("launched", ",\"busy_until\":%.6f", t + us / 1e6);
    sleep_s(quiet);
    return 0;
}

/* ---- once ---- */

static int scenario_once(void)
{
    if (setup_on(0))
        return 1;
    CHECK(launch_noop(g_stream));
    emit("ran", NULL);
    return 0;
}

/* ---- evicted ---- */

static int scenario_evicted(size_t managed, size_t pinned, double seconds)
{
    if (setup_on(0))
        return 1;
    CUdeviceptr a, b;
    CHECK(cuMemAlloc_v2(&a, managed));
    if (pinned)
        CHECK(cuMemAllocAsync(&b, pinned, g_stream));
    for (double end = now() + seconds; now() < end; sleep_s(0.05))
        CHECK(launch_noop(g_stream));
    emit("done", NULL);
    return 0;
}

#include "shim_probe_devices.c"

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    const char *s = argv[1];
    double a = argc > 2 ? atof(argv[2]) : 0, b = argc > 3 ? atof(argv[3]) : 0;
    double c = argc > 4 ? atof(argv[4]) : 0, d = argc > 5 ? atof(argv[5]) : 0;
    double e = argc > 6 ? atof(argv[6]) : 0;
    int rc = 2;
    if (!strcmp(s, "launchpaths"))
        rc = scenario_launchpaths();
    else if (!strcmp(s, "capture"))
        rc = scenario_capture(a, b, (size_t)c);
    else if (!strcmp(s, "longcapture"))
        rc = scenario_longcapture(a, (size_t)b);
    else if (!strcmp(s, "launches"))
        rc = scenario_launches(a, (unsigned long long)b, (size_t)c, 0);
    else if (!strcmp(s, "grantedlaunches"))
        rc = scenario_launches(a, (unsigned long long)b, (size_t)c, 1);
    else if (!strcmp(s, "twoctx"))
        rc = scenario_twoctx((unsigned long long)a);
    else if (!strcmp(s, "twodev"))
        rc = scenario_twodev(a, (unsigned long long)b, (size_t)c);
    else if (!strcmp(s, "otherdev"))
        rc = scenario_otherdev((int)a);
    else if (!strcmp(s, "reset"))
        rc = scenario_reset();
    else if (!strcmp(s, "ptds"))
        rc = scenario_ptds((unsigned long long)a, b);
    else if (!strcmp(s, "streams"))
        rc = scenario_streams((int)a, (unsigned long long)b, c);
    else if (!strcmp(s, "once"))
        rc = scenario_once();
    else if (!strcmp(s, "evicted"))
        rc = scenario_evicted((size_t)a, (size_t)b, c);
    else if (!strcmp(s, "twomem"))
        rc = scenario_twomem(a, (unsigned long long)b, (size_t)c, (size_t)d, e);
    else if (!strcmp(s, "twoquota"))
        rc = scenario_twoquota((size_t)a);
    emit_stats();
    printf("{\"event\":\"exit\",\"rc\":%d,\"pid\":%d}\n", rc, (int)getpid());
    fflush(stdout);
    return rc;
}
