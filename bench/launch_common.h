/*
 * What the two launch benchmarks share (launch_ab.c, launch_overhead.c): the driver entry points
 * they call, the empty kernel, and their error and clock helpers. Define BENCH_NAME (the program's
 * name in error messages) before including.
 */
#ifndef GPUSHARE_BENCH_LAUNCH_COMMON_H
#define GPUSHARE_BENCH_LAUNCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "base/cuda_abi.h"

#ifndef BENCH_NAME
#error "define BENCH_NAME before including launch_common.h"
#endif

typedef CUresult (*init_t)(unsigned int);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*retain_t)(CUcontext *, CUdevice);
typedef CUresult (*set_current_t)(CUcontext);
typedef CUresult (*module_load_t)(void **, const void *);
typedef CUresult (*get_function_t)(CUfunction *, void *, const char *);
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
typedef CUresult (*launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*sync_t)(void);

/* An empty kernel named "noop" (PTX, compiled by the driver: no CUDA toolkit needed; the stand-in
 * driver knows the same name). */
static const char PTX[] = ".version 7.0\n.target sm_50\n.address_size 64\n"
                          ".visible .entry noop()\n{\n\tret;\n}\n";

static void check(CUresult r, const char *what)
{
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, BENCH_NAME ": %s failed with CUresult %d\n", what, r);
        exit(3);
    }
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
