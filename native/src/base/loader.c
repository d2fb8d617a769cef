/*
 * Loading the real libraries (libcuda, libnvidia-ml) lazily, and the table of their real
 * functions for every hooked name. The bottom of the shim: it calls nothing of the shim's but
 * the configuration and the log, so every module may ask it for a real function.
 */
#include <dlfcn.h>
#include <link.h>

#include "shim.h"

/* Names and libraries of the hooked functions, in gs_hook_index order (hooks.def). */
static const char *const hook_names[GS_N_HOOKS] = {
#define GS_GATED(name, params, args, stream, per_thread) #name,
#define GS_CUSTOM(name, ret, params, args, handler, lib) #name,
#include "hooks.def"
#undef GS_GATED
#undef GS_CUSTOM
};
static const unsigned char hook_libs[GS_N_HOOKS] = {
#define GS_GATED(name, params, args, stream, per_thread) GS_LIB_CUDA,
#define GS_CUSTOM(name, ret, params, args, handler, lib) lib,
#include "hooks.def"
#undef GS_GATED
#undef GS_CUSTOM
};

/* Real pointers, filled once per library when it is first needed. */
_Atomic(void *) gs_real_ptrs[GS_N_HOOKS];

/* Is p an address inside this very library (one of the shim's own exports)? */
static int is_inside_shim(void *p)
{
    Dl_info mine, theirs;
    return dladdr((void *)is_inside_shim, &mine) && dladdr(p, &theirs) &&
           mine.dli_fbase == theirs.dli_fbase;
}

/* ---- the real dlsym ---- */

static dlsym_fn real_dlsym_ptr;
static pthread_once_t real_dlsym_once = PTHREAD_ONCE_INIT;

static void find_real_dlsym(void)
{
    /* dlvsym(RTLD_NEXT) from inside the shim resolves past the shim, i.e. to libc/libdl. The
     * version names cover glibc >= 2.34 (dlsym moved into libc) and the older base versions of
     * x86-64, aarch64 and i386. */
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !real_dlsym_ptr; i++)
        real_dlsym_ptr = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

dlsym_fn gs_loader_real_dlsym(void)
{
    pthread_once(&real_dlsym_once, find_real_dlsym);
    return real_dlsym_ptr;
}

/* ---- loading the real libraries, lazily ---- */

static void *cuda_handle, *nvml_handle;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;
static atomic_int cuda_ready; /* 1 once cuda_once has run (success or not) */
/* Set while this thread loads a real library: its constructors may call dlsym, and mapping their
 * answers would re-enter the pthread_once that is loading it. */
static __thread int tl_loading;

static void fill_table(void *handle, unsigned char lib)
{
    dlsym_fn rd = gs_loader_real_dlsym();
    for (int i = 0; i < GS_N_HOOKS; i++) {
        if (hook_libs[i] != lib)
            continue;
        void *p = handle && rd ? rd(handle, hook_names[i]) : NULL;
        /* A library that resolves our name to our own wrapper (it re-exports what it found in the
         * global scope) would send us into a loop: treat it as missing. */
        if (p && is_inside_shim(p))
            p = NULL;
        atomic_store_explicit(&gs_real_ptrs[i], p, memory_order_release);
    }
}

static void load_cuda(void)
{
    const char *path = gs_config()->real_libcuda;
    /* RTLD_LOCAL: loading the driver for our own use must not add its symbols to the global scope
     * (a later dlopen by the program still gets the same object, with the program's flags). */
    tl_loading = 1;
    cuda_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    tl_loading = 0;
    if (!cuda_handle)
        GS_WARN("cannot load the CUDA driver %s: %s", path, dlerror());
    fill_table(cuda_handle, GS_LIB_CUDA);
    atomic_store_explicit(&cuda_ready, 1, memory_order_release);
}

static void load_nvml(void)
{
    tl_loading = 1;
    nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    tl_loading = 0;
    fill_table(nvml_handle, GS_LIB_NVML);
}

void *gs_real_slow(enum gs_hook_index idx)
{
    gs_loader_load((enum gs_lib)hook_libs[idx]);
    return atomic_load_explicit(&gs_real_ptrs[idx], memory_order_acquire);
}

void *gs_driver_sym(const char *name)
{
    pthread_once(&cuda_once, load_cuda);
    dlsym_fn rd = gs_loader_real_dlsym();
    return cuda_handle && rd ? rd(cuda_handle, name) : NULL;
}

void *gs_nvml_sym(const char *name)
{
    pthread_once(&nvml_once, load_nvml);
    dlsym_fn rd = gs_loader_real_dlsym();
    return nvml_handle && rd ? rd(nvml_handle, name) : NULL;
}

int gs_driver_loaded(void) { return atomic_load_explicit(&cuda_ready, memory_order_acquire); }

void gs_loader_load(enum gs_lib lib)
{
    if (lib == GS_LIB_NVML)
        pthread_once(&nvml_once, load_nvml);
    else
        pthread_once(&cuda_once, load_cuda);
}

int gs_loader_busy(void) { return tl_loading; }

int gs_driver_loaded_ok(void)
{
    gs_loader_load(GS_LIB_CUDA);
    return cuda_handle != NULL;
}
