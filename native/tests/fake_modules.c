/*
 * The stand-in driver's modules and kernel launches: cuModule*, cuLaunchKernel(Ex), cooperative
 * launches, cuGraphLaunch; the kernels really compute (included by fake_libcuda.c, which owns the
 * lock, the state and the checks this file uses; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Modules and launches                                                                         */
/* ------------------------------------------------------------------------------------------ */

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    COUNT();
    NEED_CTX();
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    *module = &g_module;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule hmod) {
    COUNT();
    NEED_INIT();
    return hmod == &g_module ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    COUNT();
    NEED_CTX();
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (hmod != &g_module) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < K_COUNT; i++) {
        if (strcmp(g_funcs[i].name, name) == 0) {
            *hfunc = &g_funcs[i];
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

/* A kernel that touches a managed allocation living on the host faults it in. */
static void fault_in(CUdeviceptr p) {
    pthread_mutex_lock(&g_lock);
    struct fk_alloc *a = find_alloc_locked((uintptr_t)p, 1);
    if (a && a->kind == A_MANAGED && a->on_host && fk_managed_onto_locked(a->phys, a->size)) {
        a->on_host = 0;
        g_managed_on_host_bytes -= a->size;
        g_fault_to_device_bytes += a->size;
        note_peak();
    }
    pthread_mutex_unlock(&g_lock);
}

static CUresult launch_now(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, CUstream h,
                           int per_thread, void **params, void **extra);

/* GPUSHARE_FAKE_LAUNCH_DELAY_US: a launch spends that long inside the driver before its work is
 * queued (a thread descheduled between the gate and the driver's enqueue). g_calls_in_driver
 * counts launches in that window; each cuCtxSynchronize traces it. */

static CUresult launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                       unsigned int bx, unsigned int by, unsigned int bz, CUstream h, int per_thread,
                       void **params, void **extra) {
    static long launch_delay = -1;
    long us = env_delay_us("GPUSHARE_FAKE_LAUNCH_DELAY_US", &launch_delay);
    __atomic_fetch_add(&g_calls_in_driver, 1, __ATOMIC_SEQ_CST);
    delay_us(us);
    CUresult r = launch_now(f, gx, gy, gz, bx, by, bz, h, per_thread, params, extra);
    __atomic_fetch_sub(&g_calls_in_driver, 1, __ATOMIC_SEQ_CST);
    return r;
}

static CUresult launch_now(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, CUstream h,
                           int per_thread, void **params, void **extra) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!f || f < &g_funcs[0] || f >= &g_funcs[K_COUNT]) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (extra && !params) return CUDA_ERROR_NOT_SUPPORTED;
    if (fk_stream_captured(s)) return CUDA_SUCCESS;
    fk_async_complete(s == &g_legacy_stream ? NULL : s, UINT64_MAX); /* stream order */
    switch (f->kind) {
    case K_SLEEP: {
        if (!params || !params[0]) return CUDA_ERROR_INVALID_VALUE;
        unsigned long long us = *(const unsigned long long *)params[0];
        if (us > 60ULL * 1000 * 1000) return CUDA_ERROR_INVALID_VALUE; /* a garbage argument */
        stream_add_busy(s, us * 1000ULL);
        break;
    }
    case K_SAXPY: {
        if (!params || !params[0] || !params[1] || !params[2] || !params[3])
            return CUDA_ERROR_INVALID_VALUE;
        float a = *(const float *)params[0];
        CUdeviceptr x = *(const CUdeviceptr *)params[1];
        CUdeviceptr y = *(const CUdeviceptr *)params[2];
        int n = *(const int *)params[3];
        if (n < 0) return CUDA_ERROR_INVALID_VALUE;
        if (n > 0 && (!dev_range_ok(x, (size_t)n * sizeof(float)) ||
                      !dev_range_ok(y, (size_t)n * sizeof(float))))
            return FK_ERROR_ILLEGAL_ADDRESS;
        fault_in(x);
        fault_in(y);
        const float *xp = (const float *)(uintptr_t)x;
        float *yp = (float *)(uintptr_t)y;
        for (int i = 0; i < n; i++) yp[i] = a * xp[i] + yp[i];
        stream_add_busy(s, 1000); /* a microsecond of "work" */
        break;
    }
    default:
        break;
    }
    pthread_mutex_lock(&g_lock);
    g_kernel_counts[f->kind]++;
    g_launches++;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernelParams, extra);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernelParams, extra);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra,
                          int per_thread) {
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    if (c->numAttrs > 0 && !c->attrs) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                  c->blockDimZ, c->hStream, per_thread, params, extra);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
    COUNT();
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    COUNT();
    return launch_ex(config, f, kernelParams, extra, 1);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernelParams, NULL);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX,
                                        unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernelParams, NULL);
}

/* Any non-NULL executable graph is accepted; a launch is a microsecond of work. */
static CUresult graph_launch(CUgraphExec g, CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    if (fk_stream_captured(s)) return CUDA_SUCCESS;
    r = fk_exec_launch(g);
    if (r) return r;
    stream_add_busy(s, 1000);
    pthread_mutex_lock(&g_lock);
    g_graph_launches++;
    g_launches++;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    COUNT();
    return graph_launch(hGraphExec, hStream, 0);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    COUNT();
    return graph_launch(hGraphExec, hStream, 1);
}
