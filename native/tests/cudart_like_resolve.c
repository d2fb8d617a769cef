/*
 * cudart_like's resolution of the driver's entry points (cuGetProcAddress, or the exported
 * symbols with -DCUDART_LIKE_DIRECT) and the resolve and dlsym scenarios (included by
 * cudart_like.c; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Resolution                                                                                   */
/* ------------------------------------------------------------------------------------------ */

static uint64_t proc_flags(void) {
    return g_ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
}

static CUresult getproc(const char *name, void **out, int *status) {
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc;
    *out = NULL;
    if (g_getproc_v1) {
        rc = g_gpa1(name, out, g_version, proc_flags());
        st = rc == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS : st;
    } else {
        rc = g_gpa2(name, out, g_version, proc_flags(), &st);
    }
    if (status) *status = (int)st;
    return rc;
}

static int open_driver(void) {
#ifdef CUDART_LIKE_DIRECT
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    g_gpa1 = cuGetProcAddress;
    g_gpa2 = cuGetProcAddress_v2;
#define ASSIGN(base, sym, ptsym, params) p_##base = g_ptds ? ptsym : sym;
    API(ASSIGN)
#undef ASSIGN
#else
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!g_lib) {
        emit("error", ",\"what\":\"dlopen libcuda.so.1\",\"message\":\"%s\"", dlerror());
        return 1;
    }
    g_gpa2 = (fn_getproc_v2 *)dlsym(g_lib, "cuGetProcAddress_v2");
    g_gpa1 = (fn_getproc_v1 *)dlsym(g_lib, "cuGetProcAddress");
    if (g_getproc_v1 ? !g_gpa1 : !g_gpa2) {
        emit("error", ",\"what\":\"dlsym cuGetProcAddress%s\"", g_getproc_v1 ? "" : "_v2");
        return 1;
    }
#define RESOLVE(base, sym, ptsym, params)                                                        \
    {                                                                                            \
        void *p_;                                                                                \
        getproc(#base, &p_, NULL);                                                               \
        p_##base = (fn_##base *)p_;                                                              \
    }
    API(RESOLVE)
#undef RESOLVE
#endif
    return 0;
}

static int prefetch_is_v2(void) {
#ifdef CUDART_LIKE_DIRECT
    return 1;
#else
    return g_version >= 12020;
#endif
}

/* Where a pointer lives: library basename and nearest exported symbol. */
static void where(void *p, char *out, size_t n) {
    Dl_info info;
    if (!p) {
        snprintf(out, n, "null");
        return;
    }
    if (!dladdr(p, &info) || !info.dli_fname) {
        snprintf(out, n, "{\"lib\":null,\"sym\":null}");
        return;
    }
    const char *base = strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    int exact = info.dli_saddr == p;
    snprintf(out, n, "{\"lib\":\"%s\",\"sym\":%s%s%s,\"exact\":%s}", base,
             info.dli_sname && exact ? "\"" : "", info.dli_sname && exact ? info.dli_sname : "null",
             info.dli_sname && exact ? "\"" : "", exact ? "true" : "false");
}

static int scenario_resolve(void) {
    static const char *const extra[] = {"cuGetProcAddress", "cuCtxCreate", "cuMemAllocHost",
                                        "cuNoSuchFunction", "cuMemPrefetchAsync", "cuMemAlloc",
                                        "cuMemGetInfo",     "cuStreamDestroy"};
    char loc[512];
#define SHOW(base, sym, ptsym, params)                                                           \
    {                                                                                            \
        int st_ = -1;                                                                            \
        void *p_ = NULL;                                                                         \
        CUresult rc_ = 0;                                                                        \
        if (g_lib && !getenv("CUDART_LIKE_NO_GETPROC"))                                          \
            rc_ = getproc(#base, &p_, &st_);                                                     \
        else                                                                                     \
            p_ = (void *)p_##base;                                                               \
        where(p_, loc, sizeof(loc));                                                             \
        emit("resolved",                                                                         \
             ",\"name\":\"%s\",\"rc\":%d,\"symbol_status\":%d,\"where\":%s,\"sym\":\"%s\","            \
             "\"ptsym\":\"%s\"",                                                                  \
             #base, rc_, st_, loc, #sym, #ptsym);                                                \
    }
#ifdef CUDART_LIKE_DIRECT
    setenv("CUDART_LIKE_NO_GETPROC", "1", 1);
#endif
    API(SHOW)
#undef SHOW
#ifndef CUDART_LIKE_DIRECT
    for (size_t i = 0; i < sizeof(extra) / sizeof(extra[0]); i++) {
        void *p = NULL;
        int st = -1;
        CUresult rc = getproc(extra[i], &p, &st);
        where(p, loc, sizeof(loc));
        emit("resolved", ",\"name\":\"%s\",\"rc\":%d,\"symbol_status\":%d,\"where\":%s", extra[i],
             rc, st, loc);
    }
#else
    (void)extra;
#endif
    return 0;
}

/* The dlsym door: each exported versioned symbol looked up by name, as programs that dlopen
 * libcuda without cuGetProcAddress do. */
static int scenario_dlsym(void) {
    char loc[512];
    void *lib = g_lib ? g_lib : dlopen("libcuda.so.1", RTLD_NOW);
#define LOOKUP(base, sym, ptsym, params)                                                         \
    {                                                                                            \
        const char *names_[2] = {#sym, #ptsym};                                                  \
        for (int k_ = 0; k_ < (strcmp(#sym, #ptsym) ? 2 : 1); k_++) {                            \
            where(lib ? dlsym(lib, names_[k_]) : NULL, loc, sizeof(loc));                        \
            emit("dlsym", ",\"name\":\"%s\",\"where\":%s", names_[k_], loc);                   \
        }                                                                                        \
    }
    API(LOOKUP)
#undef LOOKUP
    static const char *const extra[] = {"cuGetProcAddress", "cuGetProcAddress_v2",
                                        "cuMemPrefetchAsync", "cuMemPrefetchAsync_ptsz",
                                        "cuMemAlloc", "cuStreamDestroy"};
    for (size_t i = 0; i < sizeof(extra) / sizeof(extra[0]); i++) {
        where(lib ? dlsym(lib, extra[i]) : NULL, loc, sizeof(loc));
        emit("dlsym", ",\"name\":\"%s\",\"where\":%s", extra[i], loc);
    }
    return 0;
}
