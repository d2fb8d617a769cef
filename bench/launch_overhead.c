/*
 * Launch-path overhead: how many nanoseconds does the shim add to a kernel launch while the
 * process holds the device?
 *
 * The program resolves the driver the way the CUDA runtime does (dlopen libcuda.so.1, then every
 * entry point through cuGetProcAddress_v2), so under LD_PRELOAD it calls the shim's wrappers
 * through the same door a framework would. It launches an empty kernel (PTX, compiled by the
 * driver: no CUDA toolkit needed) in batches and times only the launch calls, synchronising
 * between batches so the device's launch queue never fills (a full queue would measure the GPU,
 * not the launch path).
 *
 *   launch_overhead [--launches N] [--batch B] [--api kernel|kernelex]
 * Prints one JSON object: per-launch nanoseconds (median, p10, p90 over batches).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BENCH_NAME "launch_overhead"
#include "launch_common.h"

typedef CUresult (*get_proc_t)(const char *, void **, int, cuuint64_t,
                               CUdriverProcAddressQueryResult *);

static get_proc_t get_proc;

static void *resolve(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult status;
    if (get_proc(name, &fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS || !fn) {
        fprintf(stderr, "launch_overhead: cannot resolve %s\n", name);
        exit(2);
    }
    return fn;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    long launches = 200000, batch = 256;
    const char *api = "kernel";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--launches"))
            launches = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            batch = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--api"))
            api = argv[i + 1];
        else {
            fprintf(stderr, "usage: %s [--launches N] [--batch B] [--api kernel|kernelex]\n",
                    argv[0]);
            return 2;
        }
    }
    if (launches < batch || batch < 1 || (strcmp(api, "kernel") && strcmp(api, "kernelex"))) {
        fprintf(stderr, "launch_overhead: bad arguments\n");
        return 2;
    }

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "launch_overhead: %s\n", dlerror());
        return 2;
    }
    get_proc = (get_proc_t)dlsym(lib, "cuGetProcAddress_v2");
    if (!get_proc) {
        fprintf(stderr, "launch_overhead: no cuGetProcAddress_v2\n");
        return 2;
    }
    init_t init = (init_t)resolve("cuInit");
    device_get_t device_get = (device_get_t)resolve("cuDeviceGet");
    retain_t retain = (retain_t)resolve("cuDevicePrimaryCtxRetain");
    set_current_t set_current = (set_current_t)resolve("cuCtxSetCurrent");
    module_load_t module_load = (module_load_t)resolve("cuModuleLoadData");
    get_function_t get_function = (get_function_t)resolve("cuModuleGetFunction");
    launch_t launch = (launch_t)resolve("cuLaunchKernel");
    launch_ex_t launch_ex = (launch_ex_t)resolve("cuLaunchKernelEx");
    sync_t sync = (sync_t)resolve("cuCtxSynchronize");

    CUdevice dev;
    CUcontext ctx;
    void *module;
    CUfunction fn;
    check(init(0), "cuInit");
    check(device_get(&dev, 0), "cuDeviceGet");
    check(retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(set_current(ctx), "cuCtxSetCurrent");
    check(module_load(&module, PTX), "cuModuleLoadData");
    check(get_function(&fn, module, "noop"), "cuModuleGetFunction");

    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1;
    int ex = !strcmp(api, "kernelex");

    /* Warm up: the first launches load the module and (under the shim) take the grant. */
    for (int i = 0; i < 2000; i++)
        check(ex ? launch_ex(&cfg, fn, NULL, NULL) : launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL),
              "warm-up launch");
    check(sync(), "cuCtxSynchronize");

    long batches = launches / batch;
    double *per = malloc(sizeof(double) * (size_t)batches);
    if (!per)
        return 4;
    for (long b = 0; b < batches; b++) {
        uint64_t t0 = now_ns();
        for (long i = 0; i < batch; i++)
            check(ex ? launch_ex(&cfg, fn, NULL, NULL)
                     : launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL),
                  "launch");
        per[b] = (double)(now_ns() - t0) / (double)batch;
        check(sync(), "cuCtxSynchronize");
    }
    qsort(per, (size_t)batches, sizeof(double), by_value);
    printf("{\"api\": \"%s\", \"launches\": %ld, \"batch\": %ld, \"ns_median\": %.2f, "
           "\"ns_p10\": %.2f, \"ns_p90\": %.2f}\n",
           api, batches * batch, batch, per[batches / 2], per[batches / 10],
           per[batches * 9 / 10]);
    free(per);
    return 0;
}
