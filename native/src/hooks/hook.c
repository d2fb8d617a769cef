/*
 * Interposition: the three doors through which a program reaches the driver.
 *
 *  1. Exported symbols: a program linked against libcuda calls the shim's exports (generated below
 *     from hooks.def), because LD_PRELOAD puts the shim first in the lookup order.
 *  2. dlsym: the shim defines dlsym, so a dlopen()+dlsym() of libcuda (the CUDA runtime, NVML users,
 *     cuda-python) is answered here.
 *  3. cuGetProcAddress and cuGetProcAddress_v2: the CUDA runtime (>= 11.3) asks these for every
 *     entry point by base name, version and flags.
 *
 * At every door the real answer is fetched first, for exactly the request made, and the pointer it
 * returns is compared with the table of real pointers for the hooked exported names. Equal means
 * the caller asked for precisely that ABI variant, and it gets the wrapper with that signature.
 * Suffixes are never guessed: a cuGetProcAddress v1 caller (4 arguments) can only ever be handed
 * the 4-argument wrapper, because the driver handed it the 4-argument function.
 */
#include <dlfcn.h>
#include <link.h>
#include <stdlib.h>
#include <string.h>

#include "base/shim.h"
#include "memory/api.h"

/* ---- the table ---- */

struct gs_hook {
    const char *name;
    void *wrapper;
    unsigned char lib;
};

/* Declare every export first (visibility default), then list them in the table. Function pointers
 * stored as data pointers: POSIX dlsym makes the same assumption. */
#define GS_GATED(name, params, args, stream, per_thread) GS_EXPORT CUresult name params;
#define GS_CUSTOM(name, ret, params, args, handler, lib) GS_EXPORT ret name params;
#include "base/hooks.def"
#undef GS_GATED
#undef GS_CUSTOM

static const struct gs_hook gs_hooks[GS_N_HOOKS] = {
#define GS_GATED(name, params, args, stream, per_thread) {#name, (void *)name, GS_LIB_CUDA},
#define GS_CUSTOM(name, ret, params, args, handler, lib) {#name, (void *)name, lib},
#include "base/hooks.def"
#undef GS_GATED
#undef GS_CUSTOM
};

/* ---- the exports ---- */

#define GS_GATED(name, params, args, stream, per_thread)                                          \
    CUresult name params                                                                         \
    {                                                                                            \
        CUresult gate = gs_gate_enter(stream, per_thread);                                       \
        if (GS_UNLIKELY(gate != CUDA_SUCCESS))                                                   \
            return gate;                                                                         \
        gs_fn_##name real = GS_REAL(name);                                                       \
        CUresult r = GS_LIKELY(real) ? real args : CUDA_ERROR_NOT_FOUND;                         \
        gs_gate_leave();                                                                         \
        return r;                                                                                \
    }
#define GS_CUSTOM(name, ret, params, args, handler, lib)                                          \
    ret name params                                                                              \
    {                                                                                            \
        gs_fn_##name real = GS_REAL(name);                                                       \
        if (GS_UNLIKELY(!real))                                                                  \
            return (lib) == GS_LIB_NVML ? GS_NVML_ERROR_FUNCTION_NOT_FOUND                       \
                                        : CUDA_ERROR_NOT_FOUND;                                  \
        return handler(real, GS_UNPAREN args);                                                   \
    }
#include "base/hooks.def"
#undef GS_GATED
#undef GS_CUSTOM

/* cuGraphLaunch: a gated call like the GS_GATED ones, whose graph may allocate memory
 * (mem-alloc nodes): what it would back is held against the quota until it is counted, so a
 * launch past the quota is refused before the gate, with the shim's one line. */
static CUresult graph_launch(gs_fn_cuGraphLaunch real, CUgraphExec exec, CUstream stream,
                             int per_thread)
{
    uint64_t held;
    CUresult r = gs_mem_graph_launch_check(exec, &held);
    if (GS_UNLIKELY(r != CUDA_SUCCESS))
        return r;
    CUresult gate = gs_gate_enter(stream, per_thread);
    if (GS_UNLIKELY(gate != CUDA_SUCCESS)) {
        gs_mem_graph_launched(exec, gate, held);
        return gate;
    }
    r = real(exec, stream);
    gs_gate_leave();
    gs_mem_graph_launched(exec, r, held);
    return r;
}

CUresult gs_graph_launch(gs_fn_cuGraphLaunch real, CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(real, hGraphExec, hStream, 0);
}

CUresult gs_graph_launch_ptsz(gs_fn_cuGraphLaunch_ptsz real, CUgraphExec hGraphExec,
                              CUstream hStream)
{
    return graph_launch(real, hGraphExec, hStream, 1);
}

/* ---- mapping real pointers to wrappers ---- */

static atomic_ulong unwrapped_count;

/* Names returned unwrapped, each logged once (GPUSHARE_LOG=debug): the list to check coverage
 * against on a real GPU. A fixed open-addressed set of name hashes; losing an entry to a full set
 * only means a name may be logged twice. */
#define UNWRAPPED_SLOTS 2048
static _Atomic(uint64_t) unwrapped_seen[UNWRAPPED_SLOTS];

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h | 1; /* never 0, the empty slot */
}

static void note_unwrapped(const char *door, const char *name, int version, uint64_t flags)
{
    atomic_fetch_add_explicit(&unwrapped_count, 1, memory_order_relaxed);
    if (!gs_log_enabled(GS_LOG_DEBUG) || !name)
        return;
    uint64_t h = name_hash(name);
    for (unsigned i = 0; i < UNWRAPPED_SLOTS; i++) {
        unsigned slot = (unsigned)(h + i) & (UNWRAPPED_SLOTS - 1);
        uint64_t cur = atomic_load_explicit(&unwrapped_seen[slot], memory_order_relaxed);
        if (cur == h)
            return;
        if (cur == 0) {
            uint64_t expected = 0;
            if (atomic_compare_exchange_strong(&unwrapped_seen[slot], &expected, h))
                break;
            if (expected == h)
                return;
        }
    }
    if (version >= 0)
        GS_DEBUG("unwrapped: %s (%s, version %d, flags %llu)", name, door, version,
                 (unsigned long long)flags);
    else
        GS_DEBUG("unwrapped: %s (%s)", name, door);
}

unsigned long gs_unwrapped_count(void) { return atomic_load(&unwrapped_count); }

/* The wrapper for a real pointer, or NULL when it is none of ours. */
static void *wrapper_for(void *real, unsigned char lib)
{
    for (int i = 0; i < GS_N_HOOKS; i++)
        if (gs_hooks[i].lib == lib &&
            atomic_load_explicit(&gs_real_ptrs[i], memory_order_acquire) == real)
            return gs_hooks[i].wrapper;
    return NULL;
}

static int is_our_wrapper(void *p, int *idx)
{
    for (int i = 0; i < GS_N_HOOKS; i++)
        if (gs_hooks[i].wrapper == p) {
            *idx = i;
            return 1;
        }
    return 0;
}

/* ---- door 3: cuGetProcAddress ---- */

static void map_proc(const char *symbol, void **pfn, int version, uint64_t flags, const char *door)
{
    if (!pfn || !*pfn || gs_config()->disabled)
        return;
    void *w = wrapper_for(*pfn, GS_LIB_CUDA);
    if (w)
        *pfn = w;
    else if (symbol && symbol[0] == 'c' && symbol[1] == 'u')
        note_unwrapped(door, symbol, version, flags);
}

CUresult gs_getproc_v1(gs_fn_cuGetProcAddress real, const char *symbol, void **pfn,
                       int cudaVersion, cuuint64_t flags)
{
    CUresult r = real(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS)
        map_proc(symbol, pfn, cudaVersion, flags, "cuGetProcAddress");
    return r;
}

CUresult gs_getproc_v2(gs_fn_cuGetProcAddress_v2 real, const char *symbol, void **pfn,
                       int cudaVersion, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *symbolStatus)
{
    CUresult r = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS)
        map_proc(symbol, pfn, cudaVersion, flags, "cuGetProcAddress_v2");
    return r;
}

/* ---- door 2: dlsym ---- */

/*
 * RTLD_NEXT asks for "the next definition after the caller's object". Forwarded as is, the real
 * dlsym would search after the shim (it sees the shim as its caller), which for a library loaded
 * after the shim means itself or an earlier object: an interposer calling dlsym(RTLD_NEXT,
 * "malloc") would find its own malloc and recurse. So the search is done here: walk the link
 * map chain from the caller's object onwards and take the first object that itself defines the
 * name. (dlsym on an object's handle also searches its dependencies, so each hit is checked to
 * lie in that very object.)
 */
static void *dlsym_next(const void *caller, const char *name)
{
    dlsym_fn rd = gs_loader_real_dlsym();
    Dl_info info;
    struct link_map *lm = NULL;
    if (!rd || !dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) || !lm)
        return rd ? rd(RTLD_NEXT, name) : NULL;
    for (struct link_map *next = lm->l_next; next; next = next->l_next) {
        if (!next->l_name || !next->l_name[0])
            continue;
        void *h = dlopen(next->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h)
            continue;
        void *p = rd(h, name);
        dlclose(h);
        if (!p)
            continue;
        Dl_info pinfo;
        struct link_map *owner = NULL;
        if (dladdr1(p, &pinfo, (void **)&owner, RTLD_DL_LINKMAP) && owner == next)
            return p;
        /* Data symbols and absolute symbols may not map back through dladdr: accept a hit whose
         * owner cannot be determined rather than lose it. */
        if (!owner)
            return p;
    }
    return NULL;
}

static int starts_with(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Is the library `soname` in the process already? Asking does not load it. */
static int already_loaded(const char *soname)
{
    void *h = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
    if (!h)
        return 0;
    dlclose(h);
    return 1;
}

static void *map_dlsym(const char *name, void *p)
{
    int idx;
    if (is_our_wrapper(p, &idx)) {
        /* The lookup found the shim's own export (RTLD_DEFAULT, or the shim's handle). A program
         * probing for a driver feature must still see NULL when the driver lacks it. */
        return gs_real((enum gs_hook_index)idx) ? p : NULL;
    }
    if (name[0] == 'c' && name[1] == 'u') {
        /* Never load the driver for this: if it is not loaded, p cannot be one of its functions
         * (libcublas, libcudart and friends have cu* names too). */
        if (!gs_driver_loaded() && !already_loaded(gs_config()->real_libcuda))
            return p;
        gs_loader_load(GS_LIB_CUDA);
        void *w = wrapper_for(p, GS_LIB_CUDA);
        if (w)
            return w;
        if (gs_log_enabled(GS_LOG_DEBUG) && gs_driver_loaded_ok()) {
            /* Only names that really come from the driver matter for coverage. */
            Dl_info a, b;
            void *probe = gs_driver_sym("cuInit");
            if (probe && dladdr(p, &a) && dladdr(probe, &b) && a.dli_fbase == b.dli_fbase)
                note_unwrapped("dlsym", name, -1, 0);
        }
        return p;
    }
    if (starts_with(name, "nvmlDeviceGetMemoryInfo")) {
        if (!already_loaded("libnvidia-ml.so.1"))
            return p;
        gs_loader_load(GS_LIB_NVML);
        void *w = wrapper_for(p, GS_LIB_NVML);
        return w ? w : p;
    }
    return p;
}

/* Unversioned on purpose: an unversioned definition satisfies both dlsym@GLIBC_2.2.5 (old
 * binaries) and dlsym@@GLIBC_2.34 references. Python calls dlsym for every extension module it
 * imports, so the common path is the real lookup plus two character compares. */
GS_EXPORT void *dlsym(void *handle, const char *name)
{
    const void *caller = __builtin_return_address(0);
    void *p;
    if (handle == RTLD_NEXT) {
        p = dlsym_next(caller, name);
    } else {
        dlsym_fn rd = gs_loader_real_dlsym();
        p = rd ? rd(handle, name) : NULL;
    }
    if (!p) /* name is declared nonnull by <dlfcn.h>, like the real dlsym's */
        return p;
    if ((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v')) {
        if (gs_loader_busy() || gs_config()->disabled)
            return p;
        return map_dlsym(name, p);
    }
    return p;
}
