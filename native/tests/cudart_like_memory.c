/*
 * cudart_like's memory scenarios: every allocation path (alloc, quota) and the memory view
 * (meminfo: cuMemGetInfo and NVML; pin: host memory pinned) (included by cudart_like.c; not
 * compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Allocation paths                                                                             */
/* ------------------------------------------------------------------------------------------ */

struct allocation {
    CUdeviceptr ptr;
    size_t size; /* usable bytes */
    size_t mapped;
    CUmemGenericAllocationHandle handle;
    void *array; /* CUarray or CUmipmappedArray */
    int path;
};

enum {
    P_ALLOC, P_PITCH, P_MANAGED, P_ASYNC, P_POOL, P_CREATE,
    /* Ways around a quota that only allocate (no data round trip): */
    P_CREATE_RELEASED, /* cuMemCreate + map, then cuMemRelease while mapped (NCCL's free path) */
    P_CREATE_RETAINED, /* ... then cuMemRetainAllocationHandle + cuMemRelease of that */
    P_ARRAY, P_ARRAY3D, P_MIPMAP,
    P_COUNT
};
static const char *const path_names[P_COUNT] = {
    "alloc", "pitch", "managed", "async", "pool", "create",
    "create_released", "create_retained", "array", "array3d", "mipmap"};

static int path_of(const char *s) {
    for (int i = 0; i < P_COUNT; i++)
        if (strcmp(s, path_names[i]) == 0) return i;
    return -1;
}

static CUresult do_alloc(int path, size_t size, struct allocation *a) {
    memset(a, 0, sizeof(*a));
    a->path = path;
    a->size = size;
    switch (path) {
    case P_ALLOC: return p_cuMemAlloc(&a->ptr, size);
    case P_PITCH: {
        size_t width = 65536, pitch = 0;
        size_t height = (size + width - 1) / width;
        CUresult rc = p_cuMemAllocPitch(&a->ptr, &pitch, width, height, 4);
        if (rc == CUDA_SUCCESS) a->size = pitch * height;
        return rc;
    }
    case P_MANAGED: return p_cuMemAllocManaged(&a->ptr, size, CU_MEM_ATTACH_GLOBAL);
    case P_ASYNC: return p_cuMemAllocAsync(&a->ptr, size, g_stream);
    case P_POOL: {
        CUmemoryPool pool;
        CUresult rc = p_cuDeviceGetDefaultMemPool(&pool, g_dev);
        if (rc) return rc;
        return p_cuMemAllocFromPoolAsync(&a->ptr, size, pool, g_stream);
    }
    case P_CREATE_RELEASED:
    case P_CREATE_RETAINED: {
        CUresult rc = do_alloc(P_CREATE, size, a);
        a->path = path;
        if (rc) return rc;
        if (path == P_CREATE_RETAINED) {
            CUmemGenericAllocationHandle again = 0;
            rc = p_cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)a->ptr);
            if (rc) return rc;
            if (again != a->handle) return CUDA_ERROR_UNKNOWN;
        }
        return p_cuMemRelease(a->handle); /* still mapped: the memory stays */
    }
    case P_ARRAY: {
        /* FLOAT, one channel: 4 bytes an element, rows of 4096 elements. */
        CUDA_ARRAY_DESCRIPTOR d = {4096, size / (4096 * 4), 0x20, 1};
        return p_cuArrayCreate((CUarray *)&a->array, &d);
    }
    case P_ARRAY3D: {
        CUDA_ARRAY3D_DESCRIPTOR d = {1024, 1024, size / (1024 * 1024 * 4), 0x20, 1, 0};
        return p_cuArray3DCreate((CUarray *)&a->array, &d);
    }
    case P_MIPMAP: {
        CUDA_ARRAY3D_DESCRIPTOR d = {4096, size / (4096 * 4), 0, 0x20, 1, 0};
        return p_cuMipmappedArrayCreate((CUmipmappedArray *)&a->array, &d, 1);
    }
    case P_CREATE: {
        struct CUmemAllocationProp_st prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = g_dev;
        size_t gran = 0;
        CUresult rc = p_cuMemGetAllocationGranularity(&gran, &prop, 0);
        if (rc) return rc;
        size_t rounded = (size + gran - 1) / gran * gran;
        rc = p_cuMemCreate(&a->handle, rounded, &prop, 0);
        if (rc) return rc;
        rc = p_cuMemAddressReserve(&a->ptr, rounded, 0, 0, 0);
        if (rc) {
            p_cuMemRelease(a->handle);
            return rc;
        }
        rc = p_cuMemMap(a->ptr, rounded, 0, a->handle, 0);
        if (rc) {
            p_cuMemAddressFree(a->ptr, rounded);
            p_cuMemRelease(a->handle);
            return rc;
        }
        CUmemAccessDesc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, g_dev}, 3};
        rc = p_cuMemSetAccess(a->ptr, rounded, &desc, 1);
        a->mapped = rounded;
        a->size = rounded;
        return rc;
    }
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult do_free(struct allocation *a) {
    switch (a->path) {
    case P_ASYNC:
    case P_POOL: {
        CUresult rc = p_cuMemFreeAsync(a->ptr, g_stream);
        if (rc) return rc;
        return p_cuStreamSynchronize(g_stream);
    }
    case P_CREATE: {
        CUresult rc = p_cuMemUnmap(a->ptr, a->mapped);
        if (rc) return rc;
        rc = p_cuMemRelease(a->handle);
        if (rc) return rc;
        return p_cuMemAddressFree(a->ptr, a->mapped);
    }
    case P_CREATE_RETAINED:
    case P_CREATE_RELEASED: {
        /* The retain's own reference, then the memory goes at its last unmap. */
        CUresult rc = a->path == P_CREATE_RETAINED ? p_cuMemRelease(a->handle) : CUDA_SUCCESS;
        if (rc) return rc;
        rc = p_cuMemUnmap(a->ptr, a->mapped);
        if (rc) return rc;
        return p_cuMemAddressFree(a->ptr, a->mapped);
    }
    case P_ARRAY:
    case P_ARRAY3D: return p_cuArrayDestroy((CUarray)a->array);
    case P_MIPMAP: return p_cuMipmappedArrayDestroy((CUmipmappedArray)a->array);
    default: return p_cuMemFree(a->ptr);
    }
}

/* Write a pattern through cuMemsetD32 and cuMemcpyHtoD, read it back with cuMemcpyDtoH. */
static int round_trip(CUdeviceptr p, size_t size) {
    size_t n = size < (1u << 20) ? size : (1u << 20);
    n &= ~(size_t)3;
    if (n == 0) return 1;
    unsigned char *h = malloc(n);
    if (!h) return 0;
    int ok = p_cuMemsetD32(p, 0xA5C3E1F0u, n / 4) == CUDA_SUCCESS &&
             p_cuMemcpyDtoH(h, p, n) == CUDA_SUCCESS;
    for (size_t i = 0; ok && i < n; i += 4) {
        uint32_t v;
        memcpy(&v, h + i, 4);
        ok = v == 0xA5C3E1F0u;
    }
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 7 + 3);
    ok = ok && p_cuMemcpyHtoD(p, h, n) == CUDA_SUCCESS;
    memset(h, 0, n);
    ok = ok && p_cuMemcpyDtoH(h, p, n) == CUDA_SUCCESS;
    for (size_t i = 0; ok && i < n; i++) ok = h[i] == (unsigned char)(i * 7 + 3);
    free(h);
    return ok;
}

static void meminfo_fields(char *out, size_t n) {
    size_t fr = 0, tot = 0, dev_total = 0;
    CUresult rc = p_cuMemGetInfo(&fr, &tot);
    CUresult rc_total = p_cuDeviceTotalMem(&dev_total, 0);
    snprintf(out, n, ",\"rc\":%d,\"free\":%zu,\"total\":%zu,\"device_total_rc\":%d,"
             "\"device_total\":%zu", rc, fr, tot, rc_total, dev_total);
}

static int scenario_alloc(int path, size_t size) {
    char mi[256], st[2048];
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", "%s", mi);
    struct allocation a;
    CUresult rc = do_alloc(path, size, &a);
    status_fields(st, sizeof(st));
    emit("alloc", ",\"path\":\"%s\",\"size\":%zu,\"rc\":%d,\"ptr\":%llu%s", path_names[path], size,
         rc, (unsigned long long)a.ptr, st);
    if (rc) return 1;
    int ok = round_trip(a.ptr, a.size);
    emit("data", ",\"ok\":%s", ok ? "true" : "false");
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", "%s", mi);
    rc = do_free(&a);
    status_fields(st, sizeof(st));
    emit("free", ",\"path\":\"%s\",\"rc\":%d%s", path_names[path], rc, st);
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", "%s", mi);
    return rc != CUDA_SUCCESS || !ok;
}

static int scenario_quota(size_t size, int path, long max) {
    struct allocation *as = calloc((size_t)max, sizeof(*as));
    if (!as) return 1;
    long count = 0;
    CUresult rc = CUDA_SUCCESS;
    size_t total = 0;
    while (count < max) {
        rc = do_alloc(path, size, &as[count]);
        if (rc != CUDA_SUCCESS) break;
        total += as[count].size;
        count++;
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("quota", ",\"path\":\"%s\",\"size\":%zu,\"count\":%ld,\"allocated\":%zu,\"rc\":%d%s",
         path_names[path], size, count, total, rc, st);
    int bad = 0;
    for (long i = 0; i < count; i++) bad |= do_free(&as[i]) != CUDA_SUCCESS;
    /* After freeing, the same allocation must succeed again. */
    struct allocation again;
    CUresult rc2 = count > 0 ? do_alloc(path, size, &again) : CUDA_SUCCESS;
    if (count > 0 && rc2 == CUDA_SUCCESS) do_free(&again);
    status_fields(st, sizeof(st));
    emit("quota_freed", ",\"free_errors\":%d,\"realloc_rc\":%d%s", bad, rc2, st);
    free(as);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory view                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef nvmlReturn_t fn_nvml_init(void);
typedef nvmlReturn_t fn_nvml_handle(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t fn_nvml_mem(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t fn_nvml_mem2(nvmlDevice_t, nvmlMemory_v2_t *);

/* The processes NVML lists on `dev` with their bytes (nvmlDeviceGetComputeRunningProcesses_v3),
 * as a JSON field: ,"processes":{"rc":R,"list":[[pid,bytes],...]}. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} probe_process_info;
typedef nvmlReturn_t fn_nvml_procs(nvmlDevice_t, unsigned int *, probe_process_info *);

static void nvml_processes(void *lib, nvmlDevice_t dev, char *out, size_t n) {
    fn_nvml_procs *procs = (fn_nvml_procs *)dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
    probe_process_info rows[16];
    unsigned int count = 16;
    int rc = procs ? (int)procs(dev, &count, rows) : -1;
    size_t off = (size_t)snprintf(out, n, ",\"processes\":{\"rc\":%d,\"list\":[", rc);
    for (unsigned int i = 0; rc == 0 && i < count && i < 16 && off < n; i++)
        off += (size_t)snprintf(out + off, n - off, "%s[%u,%llu]", i ? "," : "", rows[i].pid,
                                rows[i].usedGpuMemory);
    if (off < n) snprintf(out + off, n - off, "]}");
}

static void emit_nvml(const char *when) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        emit("nvml", ",\"when\":\"%s\",\"available\":false", when);
        return;
    }
    fn_nvml_init *init = (fn_nvml_init *)dlsym(lib, "nvmlInit_v2");
    fn_nvml_handle *get = (fn_nvml_handle *)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    fn_nvml_mem *mem = (fn_nvml_mem *)dlsym(lib, "nvmlDeviceGetMemoryInfo");
    fn_nvml_mem2 *mem2 = (fn_nvml_mem2 *)dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
    nvmlDevice_t dev = NULL;
    if (!init || !get || !mem || !mem2 || init() != NVML_SUCCESS || get(0, &dev) != NVML_SUCCESS) {
        emit("nvml", ",\"when\":\"%s\",\"available\":false", when);
        return;
    }
    nvmlMemory_t m1;
    nvmlMemory_v2_t m2;
    memset(&m1, 0, sizeof(m1));
    memset(&m2, 0, sizeof(m2));
    m2.version = (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24));
    int r1 = mem(dev, &m1), r2 = mem2(dev, &m2);
    char procs[1024];
    nvml_processes(lib, dev, procs, sizeof procs);
    emit("nvml",
         ",\"when\":\"%s\",\"available\":true,\"v1\":{\"rc\":%d,\"total\":%llu,\"free\":%llu,"
         "\"used\":%llu},\"v2\":{\"rc\":%d,\"total\":%llu,\"free\":%llu,\"used\":%llu,"
         "\"reserved\":%llu}%s",
         when, r1, m1.total, m1.free, m1.used, r2, m2.total, m2.free, m2.used, m2.reserved, procs);
}

/* Pins BYTES of host memory (cuMemHostRegister, as a program's staging buffer is), holds it for
 * SECONDS, and lets it go; "pinned" carries the driver's answer. */
typedef CUresult fn_host_register(void *, size_t, unsigned int);
typedef CUresult fn_host_unregister(void *);

static int scenario_pin(size_t bytes, double seconds) {
    void *reg = NULL, *unreg = NULL;
    getproc("cuMemHostRegister", &reg, NULL);
    getproc("cuMemHostUnregister", &unreg, NULL);
    if (!reg || !unreg) return fail("cuGetProcAddress(cuMemHostRegister)", CUDA_ERROR_NOT_FOUND);
    void *h = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (h == MAP_FAILED) return fail("mmap", CUDA_ERROR_OUT_OF_MEMORY);
    CUresult rc = ((fn_host_register *)reg)(h, bytes, 0);
    emit("pinned", ",\"bytes\":%zu,\"rc\":%d", bytes, rc);
    sleep_s(seconds);
    if (rc == CUDA_SUCCESS) CHECK(((fn_host_unregister *)unreg)(h));
    emit("unpinned", ",\"bytes\":%zu", bytes);
    munmap(h, bytes);
    return rc != CUDA_SUCCESS;
}

static int scenario_meminfo(size_t bytes) {
    char mi[256];
    /* One launch first: a connected process has then had its handshake (the pool is known). */
    CHECK(launch_sleep(0));
    CHECK(p_cuStreamSynchronize(work_stream()));
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", ",\"when\":\"before\"%s", mi);
    emit_nvml("before");
    struct allocation a = {0};
    if (bytes) {
        CUresult rc = do_alloc(P_ALLOC, bytes, &a);
        emit("alloc", ",\"path\":\"alloc\",\"size\":%zu,\"rc\":%d", bytes, rc);
        if (rc) return 1;
    }
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", ",\"when\":\"after\"%s", mi);
    emit_nvml("after");
    emit_status("status");
    if (bytes) do_free(&a);
    return 0;
}
