/*
 * The stand-in driver's initialisation, devices (CUDA_VISIBLE_DEVICES) and contexts: cuInit,
 * cuDeviceGet*, the primary context, cuCtx* (included by fake_libcuda.c, which owns the lock,
 * the state and the checks this file uses; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Initialisation, device, context                                                              */
/* ------------------------------------------------------------------------------------------ */

/* CUDA_VISIBLE_DEVICES: ordinal -> physical device. */
static int g_vis[FK_MAX_DEV], g_nvis = -1;
static pthread_once_t g_vis_once = PTHREAD_ONCE_INIT;

static int fk_match_token(const char *tok, int ndev) {
    size_t len = strlen(tok);
    int digits = len > 0;
    for (size_t i = 0; i < len; i++) digits &= isdigit((unsigned char)tok[i]) != 0;
    if (digits) {
        int idx = atoi(tok);
        return idx < ndev ? idx : -1;
    }
    char want[96];
    snprintf(want, sizeof want, "%s%s", strncasecmp(tok, "GPU-", 4) == 0 ? "" : "GPU-", tok);
    int found = -1;
    for (int d = 0; d < ndev; d++) {
        char u[64];
        fk_phys_uuid_string(d, u, sizeof u);
        if (strncasecmp(u, want, strlen(want)) == 0) {
            if (found >= 0) return -1; /* ambiguous prefix */
            found = d;
        }
    }
    return found;
}

static void fk_vis_init(void) {
    int ndev = fk_ndev(), n = 0;
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (!env) {
        for (int d = 0; d < ndev; d++) g_vis[n++] = d;
        g_nvis = n;
        return;
    }
    char item[128];
    for (int i = 0; n < FK_MAX_DEV && fk_item(env, i, item, sizeof item); i++) {
        char *t = item;
        while (*t == ' ') t++;
        size_t len = strlen(t);
        while (len > 0 && t[len - 1] == ' ') t[--len] = 0;
        int d = fk_match_token(t, ndev);
        int dup = 0;
        for (int k = 0; k < n; k++) dup |= g_vis[k] == d;
        if (d < 0 || dup) break;
        g_vis[n++] = d;
    }
    g_nvis = n;
}

static int fk_nvis(void) {
    pthread_once(&g_vis_once, fk_vis_init);
    return g_nvis;
}

/* The physical device of ordinal `dev`, or -1 when no visible device has that ordinal. */
static int fk_phys(CUdevice dev) {
    int n = fk_nvis();
    return dev >= 0 && dev < n ? g_vis[dev] : -1;
}

/* Test-only export: the physical device this process's allocations are counted on. */
int fakecuda_physical_device(void) {
    CUcontext c = cur_ctx();
    int phys = fk_phys(c ? c->dev : 0);
    return phys < 0 ? 0 : phys;
}

static int fk_cur_phys(void) { return fakecuda_physical_device(); }

static unsigned long long fk_device_total(void) {
    return fk_phys_total(fakecuda_physical_device());
}

CUresult cuInit(unsigned int flags) {
    COUNT();
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (fk_nvis() == 0) return 100; /* CUDA_ERROR_NO_DEVICE: CUDA_VISIBLE_DEVICES hides them all */
    g_inited = 1;
    static pthread_once_t ckpt_once = PTHREAD_ONCE_INIT;
    pthread_once(&ckpt_once, fk_ckpt_start);
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    COUNT();
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("GPUSHARE_FAKE_DRIVER_VERSION");
    *driverVersion = v && *v ? atoi(v) : 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    COUNT();
    NEED_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(ordinal) < 0) return FK_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    COUNT();
    NEED_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = fk_nvis();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", "gpushare stand-in GPU");
    return CUDA_SUCCESS;
}

static CUresult fill_uuid(CUuuid *uuid, CUdevice dev) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    int phys = fk_phys(dev);
    if (phys < 0) return FK_ERROR_INVALID_DEVICE;
    fk_phys_uuid(phys, (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    COUNT();
    return fill_uuid(uuid, dev);
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    COUNT();
    return fill_uuid(uuid, dev);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    *bytes = (size_t)fk_phys_total(fk_phys(dev));
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 16: *pi = 132; break;  /* MULTIPROCESSOR_COUNT */
    case 75: *pi = 9; break;    /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *pi = 0; break;    /* COMPUTE_CAPABILITY_MINOR */
    case 83: *pi = 1; break;    /* MANAGED_MEMORY */
    case 89: *pi = 1; break;    /* CONCURRENT_MANAGED_ACCESS */
    case 115: *pi = 1; break;   /* MEMORY_POOLS_SUPPORTED */
    case 102: *pi = 1; break;   /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    *pool_out = &g_default_pools[dev];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    CUresult r = fk_context_take(fk_phys(dev));
    if (r) return r;
    __atomic_fetch_add(&g_primary_refs[dev], 1, __ATOMIC_RELAXED);
    *pctx = &g_primary[dev];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    if (__atomic_load_n(&g_primary_refs[dev], __ATOMIC_RELAXED) <= 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    __atomic_fetch_sub(&g_primary_refs[dev], 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    COUNT();
    NEED_INIT();
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    if (flags) *flags = 0;
    if (active) *active = __atomic_load_n(&g_primary_refs[dev], __ATOMIC_RELAXED) > 0;
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    if (t_ctx_depth >= 32) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fk_context_take(fk_phys(dev));
    if (r) return r;
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = CTX_MAGIC;
    c->dev = dev;
    t_ctx_stack[t_ctx_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

/* v1 (cudaVersion < 3020): 32-bit ABI nobody uses any more; present so that a request for an
 * old version resolves to a distinct function, as on the real driver. */
CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    COUNT();
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    COUNT();
    return ctx_create(pctx, dev);
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                        unsigned int flags, CUdevice dev) {
    COUNT();
    return ctx_create(pctx, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                        CUdevice dev) {
    COUNT();
    return ctx_create(pctx, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    COUNT();
    NEED_INIT();
    if (!ctx_ok(ctx) || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = t_ctx_depth - 1; i >= 0; i--) {
        if (t_ctx_stack[i] == ctx) {
            memmove(&t_ctx_stack[i], &t_ctx_stack[i + 1],
                    (size_t)(t_ctx_depth - i - 1) * sizeof(CUcontext));
            t_ctx_depth--;
        }
    }
    ctx->magic = 0; /* leaked on purpose: a use after destroy is then detected */
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    COUNT();
    NEED_INIT();
    if (ctx == NULL) {
        if (t_ctx_depth > 0) t_ctx_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_ok(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth == 0)
        t_ctx_stack[t_ctx_depth++] = ctx;
    else
        t_ctx_stack[t_ctx_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    COUNT();
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = cur_ctx();
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    COUNT();
    NEED_INIT();
    if (!ctx_ok(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth >= 32) return CUDA_ERROR_OUT_OF_MEMORY;
    t_ctx_stack[t_ctx_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    COUNT();
    NEED_INIT();
    if (t_ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_ctx_stack[--t_ctx_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    COUNT();
    NEED_CTX();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = cur_ctx()->dev;
    return CUDA_SUCCESS;
}

/* With GPUSHARE_FAKE_TRACE, each synchronisation leaves a line saying which thread waited, from
 * when to when, and until when the device was busy as it began: what the quit tests read to see
 * that a process killed mid-kernel waited for its work (the line is out before the process dies). */
CUresult cuCtxSynchronize(void) {
    COUNT();
    NEED_CTX();
    const char *fails = getenv("GPUSHARE_FAKE_CTX_SYNC_FAILS");
    if (fails && *fails && unlink(fails) == 0) return CUDA_ERROR_UNKNOWN; /* once, then gone */
    if (fk_capture_unsafe_call()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    uint64_t begin = now_ns();
    int in_driver = __atomic_load_n(&g_calls_in_driver, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&g_lock);
    uint64_t until = g_device_busy_until, ctx_until = cur_ctx()->busy_until;
    pthread_mutex_unlock(&g_lock);
    sleep_until_ns(ctx_until); /* a context waits for its own work only */
    fk_async_complete(NULL, UINT64_MAX);
    FILE *f = trace_file();
    if (f) {
        char name[32] = "";
        pthread_getname_np(pthread_self(), name, sizeof(name));
        fprintf(f,
                "{\"op\":\"ctx_sync\",\"pid\":%d,\"thread\":\"%s\",\"t_begin\":%.6f,"
                "\"t_end\":%.6f,\"busy_until\":%.6f,\"dev\":%d,\"ctx_busy_until\":%.6f,"
                "\"calls_in_driver\":%d}\n",
                (int)getpid(), name, begin / 1e9, now_ns() / 1e9, until / 1e9, cur_ctx()->dev,
                ctx_until / 1e9, in_driver);
    }
    return CUDA_SUCCESS;
}
