/*
 * Launch-path overhead, measured in ONE process: the shim's launch wrappers against the driver's
 * real entry points, alternated in the same context, stream, core and address layout.
 *
 * No LD_PRELOAD. The program dlopen()s the real driver (libcuda.so.1) and the shim, both
 * RTLD_NOW|RTLD_LOCAL, and takes cuLaunchKernel / cuLaunchKernelEx from each handle with
 * dlsym(handle, ...): "real" is the driver's function, "shim" is the shim's exported wrapper
 * (gate check, call counter, stream note, then the driver's function). The shim, loaded locally,
 * finds the driver itself (dlopen of GPUSHARE_REAL_LIBCUDA, default libcuda.so.1: the same object
 * this program loaded) and never resolves its "real" pointers to its own wrappers (loader.c,
 * fill_table), so the wrapper is exactly the code an LD_PRELOADed process runs per launch.
 *
 * The context comes from the SHIM's cuDevicePrimaryCtxRetain, so the shim's client starts and
 * registers with the scheduler named by GPUSHARE_SOCKET (or runs unshared without one); the first
 * shim launch opens the gate (the device is granted), after which every shim launch takes the
 * gate's fast path: "the device held under a scheduler".
 *
 * Then ROUNDS rounds; in each, both sides run SUB batches of BATCH launches, synchronising after
 * every batch (so the launch queue never fills: a full queue would time the GPU) and timing only
 * the launch calls. Order within a round alternates real,shim / shim,real (ABBA over two rounds).
 *
 *   launch_ab --shim PATH [--driver libcuda.so.1] [--rounds 200] [--sub 40] [--batch 256]
 *             [--api kernel|kernelex]
 * Prints one JSON object: per-round ns per launch for each side.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BENCH_NAME "launch_ab"
#include "launch_common.h"

static void *sym(void *handle, const char *what, const char *name)
{
    void *p = dlsym(handle, name);
    if (!p) {
        fprintf(stderr, "launch_ab: %s has no %s\n", what, name);
        exit(2);
    }
    return p;
}

static CUfunction fn;
static CUlaunchConfig cfg;
static sync_t sync_fn;

/* Nanoseconds per launch over sub batches of `batch` launches through one pointer. */
static double side(int ex, launch_t launch, launch_ex_t launch_ex, long sub, long batch)
{
    uint64_t spent = 0;
    for (long s = 0; s < sub; s++) {
        uint64_t t0 = now_ns();
        if (ex)
            for (long i = 0; i < batch; i++)
                check(launch_ex(&cfg, fn, NULL, NULL), "launch");
        else
            for (long i = 0; i < batch; i++)
                check(launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), "launch");
        spent += now_ns() - t0;
        check(sync_fn(), "cuCtxSynchronize");
    }
    return (double)spent / (double)(sub * batch);
}

int main(int argc, char **argv)
{
    long rounds = 200, sub = 40, batch = 256;
    const char *api = "kernel", *shim_path = NULL, *driver_path = "libcuda.so.1";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rounds"))
            rounds = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--sub"))
            sub = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            batch = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--api"))
            api = argv[i + 1];
        else if (!strcmp(argv[i], "--shim"))
            shim_path = argv[i + 1];
        else if (!strcmp(argv[i], "--driver"))
            driver_path = argv[i + 1];
        else {
            fprintf(stderr,
                    "usage: %s --shim PATH [--driver LIB] [--rounds R] [--sub S] [--batch B] "
                    "[--api kernel|kernelex]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!shim_path || rounds < 2 || sub < 1 || batch < 1 ||
        (strcmp(api, "kernel") && strcmp(api, "kernelex"))) {
        fprintf(stderr, "launch_ab: bad arguments (--shim is required)\n");
        return 2;
    }
    void *drv = dlopen(driver_path, RTLD_NOW | RTLD_LOCAL);
    if (!drv) {
        fprintf(stderr, "launch_ab: %s\n", dlerror());
        return 2;
    }
    void *shim = dlopen(shim_path, RTLD_NOW | RTLD_LOCAL);
    if (!shim) {
        fprintf(stderr, "launch_ab: %s\n", dlerror());
        return 2;
    }
    init_t init = (init_t)sym(drv, "driver", "cuInit");
    device_get_t device_get = (device_get_t)sym(drv, "driver", "cuDeviceGet");
    /* The shim's retain: the shim sees the context and starts its client (registration). */
    retain_t retain = (retain_t)sym(shim, "shim", "cuDevicePrimaryCtxRetain");
    set_current_t set_current = (set_current_t)sym(drv, "driver", "cuCtxSetCurrent");
    module_load_t module_load = (module_load_t)sym(drv, "driver", "cuModuleLoadData");
    get_function_t get_function = (get_function_t)sym(drv, "driver", "cuModuleGetFunction");
    sync_fn = (sync_t)sym(drv, "driver", "cuCtxSynchronize");
    launch_t real_launch = (launch_t)sym(drv, "driver", "cuLaunchKernel");
    launch_ex_t real_launch_ex = (launch_ex_t)sym(drv, "driver", "cuLaunchKernelEx");
    launch_t shim_launch = (launch_t)sym(shim, "shim", "cuLaunchKernel");
    launch_ex_t shim_launch_ex = (launch_ex_t)sym(shim, "shim", "cuLaunchKernelEx");
    if ((void *)shim_launch == (void *)real_launch || (void *)shim_launch_ex == (void *)real_launch_ex) {
        fprintf(stderr, "launch_ab: the shim handle answered the driver's own functions\n");
        return 2;
    }

    CUdevice dev;
    CUcontext ctx;
    void *module;
    check(init(0), "cuInit");
    check(device_get(&dev, 0), "cuDeviceGet");
    check(retain(&ctx, dev), "cuDevicePrimaryCtxRetain (shim)");
    check(set_current(ctx), "cuCtxSetCurrent");
    check(module_load(&module, PTX), "cuModuleLoadData");
    check(get_function(&fn, module, "noop"), "cuModuleGetFunction");
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1;
    int ex = !strcmp(api, "kernelex");

    /* Warm-up: the first shim launch waits for the grant and opens the gate; both paths then run
     * warm (caches, branch predictors, the driver's first-launch work). */
    side(ex, shim_launch, shim_launch_ex, 8, batch);
    side(ex, real_launch, real_launch_ex, 8, batch);

    double *real = malloc(sizeof(double) * (size_t)rounds);
    double *under = malloc(sizeof(double) * (size_t)rounds);
    if (!real || !under)
        return 4;
    for (long r = 0; r < rounds; r++) {
        if (r % 2 == 0) {
            real[r] = side(ex, real_launch, real_launch_ex, sub, batch);
            under[r] = side(ex, shim_launch, shim_launch_ex, sub, batch);
        } else {
            under[r] = side(ex, shim_launch, shim_launch_ex, sub, batch);
            real[r] = side(ex, real_launch, real_launch_ex, sub, batch);
        }
    }
    printf("{\"api\": \"%s\", \"rounds\": %ld, \"launches_per_side_round\": %ld, \"batch\": %ld, "
           "\"real_ns\": [",
           api, rounds, sub * batch, batch);
    for (long r = 0; r < rounds; r++)
        printf("%s%.3f", r ? ", " : "", real[r]);
    printf("], \"shim_ns\": [");
    for (long r = 0; r < rounds; r++)
        printf("%s%.3f", r ? ", " : "", under[r]);
    printf("]}\n");
    free(real);
    free(under);
    return 0;
}
