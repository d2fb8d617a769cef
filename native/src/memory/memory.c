/*
 * The memory hooks: every allocation path of the driver API (hooks.def), counted against the
 * quota (memory/table.c), and the bulk moves done at a handoff. cudaMalloc's memory is explicit
 * (memory/vmm.c, moved by memory/move.c) unless GPUSHARE_MEMORY says otherwise; the program's own
 * managed memory moves by prefetch.
 */
#include <stdlib.h>
#include <string.h>

#include "memory.h"

/* Private streams for managed prefetches, one per device, in the context they were made in. */
static struct {
    CUcontext ctx;
    CUstream s;
} prefetch_streams[GS_MEM_DEVICES];

/* The private stream of the current context's device (made when first needed, or again when
 * that device's current context is another). NULL when the driver refuses one. */
static CUstream prefetch_stream(void)
{
    typedef CUresult (*stream_create_fn)(CUstream *, unsigned int);
    typedef CUresult (*ctx_cur_fn)(CUcontext *);
    ctx_cur_fn cur_fn = (ctx_cur_fn)gs_driver_sym("cuCtxGetCurrent");
    CUcontext cur = NULL;
    if (cur_fn)
        cur_fn(&cur);
    int d = gs_mem_current_slot();
    if (prefetch_streams[d].ctx != cur || !prefetch_streams[d].s) {
        stream_create_fn create = (stream_create_fn)gs_driver_sym("cuStreamCreate");
        prefetch_streams[d].ctx = cur;
        if (!create || create(&prefetch_streams[d].s, GS_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
            prefetch_streams[d].s = NULL;
            GS_WARN("cannot create the stream for moving memory; pages will move on demand");
        }
    }
    return prefetch_streams[d].s;
}

/* ---- allocation handlers (hooks.def) ---- */

/* cudaMalloc's memory, by GPUSHARE_MEMORY: explicit (vmm, the default: the shim owns the physical
 * memory behind a stable address), managed (moved by prefetch and page faults) or plain device
 * memory (counted, never moved). Each falls back to the next where the driver cannot do it. */
static CUresult alloc_movable(gs_fn_cuMemAllocManaged managed, CUdeviceptr *dptr, size_t bytes,
                              uint8_t *kind)
{
    int mode = gs_config()->memory_mode;
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    if (mode == GS_MEMORY_VMM) {
        r = gs_vmm_alloc(dptr, bytes); /* counts itself */
        *kind = KIND_ENGINE;
        if (r == CUDA_SUCCESS)
            gs_vmm_preparer_start(); /* its staging is made in the background */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            return r;
    }
    if (mode != GS_MEMORY_DEVICE && managed) {
        r = gs_memtab_reserve(bytes);
        if (r != CUDA_SUCCESS)
            return r;
        r = managed(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
        if (r != CUDA_ERROR_NOT_SUPPORTED) {
            *kind = KIND_MANAGED;
            return gs_memtab_settle(r, bytes, dptr, NS_PTR, bytes, KIND_MANAGED);
        }
        gs_memtab_unreserve(bytes);
        GS_INFO("managed memory is not supported here: using device memory (not evictable)");
    }
    *kind = KIND_DEVICE;
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult gs_mem_alloc(gs_fn_cuMemAlloc_v2 real, CUdeviceptr *dptr, size_t bytesize)
{
    if (gs_config()->disabled || !dptr || !bytesize)
        return real(dptr, bytesize); /* the driver gives the right error for bad arguments */
    uint8_t kind;
    CUresult r = alloc_movable(GS_REAL(cuMemAllocManaged), dptr, bytesize, &kind);
    if (kind != KIND_DEVICE)
        return r;
    r = gs_memtab_reserve(bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    return gs_memtab_settle(real(dptr, bytesize), bytesize, dptr, NS_PTR, bytesize, KIND_DEVICE);
}

CUresult gs_mem_alloc_pitch(gs_fn_cuMemAllocPitch_v2 real, CUdeviceptr *dptr, size_t *pPitch,
                            size_t WidthInBytes, size_t Height, unsigned int ElementSizeBytes)
{
    int valid = dptr && pPitch && WidthInBytes && Height &&
                (ElementSizeBytes == 4 || ElementSizeBytes == 8 || ElementSizeBytes == 16);
    if (gs_config()->disabled || !valid)
        return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* 512 bytes: at least the texture pitch alignment of every GPU the driver supports, so rows
     * stay aligned the way callers of cuMemAllocPitch expect. */
    size_t pitch = (WidthInBytes + 511) & ~(size_t)511;
    if (pitch < WidthInBytes || Height > SIZE_MAX / pitch)
        return CUDA_ERROR_INVALID_VALUE;
    size_t bytes = pitch * Height;
    uint8_t kind;
    CUresult r = alloc_movable(GS_REAL(cuMemAllocManaged), dptr, bytes, &kind);
    if (kind != KIND_DEVICE) {
        if (r == CUDA_SUCCESS)
            *pPitch = pitch;
        return r;
    }
    r = gs_memtab_reserve(bytes);
    if (r != CUDA_SUCCESS)
        return r;
    r = real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    return gs_memtab_settle(r, bytes, dptr, NS_PTR, r == CUDA_SUCCESS ? (uint64_t)*pPitch * Height : 0,
                  KIND_DEVICE);
}

CUresult gs_mem_alloc_managed(gs_fn_cuMemAllocManaged real, CUdeviceptr *dptr, size_t bytesize,
                              unsigned int flags)
{
    if (gs_config()->disabled || !dptr || !bytesize)
        return real(dptr, bytesize, flags);
    CUresult r = gs_memtab_reserve(bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    return gs_memtab_settle(real(dptr, bytesize, flags), bytesize, dptr, NS_PTR, bytesize, KIND_MANAGED);
}

/* cuMemAllocAsync, cuMemAllocFromPoolAsync: memory/reserves.c (the pools' reserves too). */

/* Physical memory of the virtual memory management API (PyTorch expandable segments, NCCL):
 * counted per handle from cuMemCreate to cuMemRelease, however often it is mapped. */
CUresult gs_mem_create(gs_fn_cuMemCreate real, CUmemGenericAllocationHandle *handle, size_t size,
                       const CUmemAllocationProp *prop, unsigned long long flags)
{
    if (gs_config()->disabled || !handle || !size)
        return real(handle, size, prop, flags);
    /* Physical memory lives on the device its properties name, whichever context is current. */
    CUdevice dev = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                       ? (CUdevice)prop->location.id
                       : (CUdevice)gs_mem_current_slot();
    CUresult r = gs_memtab_reserve_on(dev, size);
    if (r != CUDA_SUCCESS)
        return r;
    return gs_memtab_settle_on(dev, real(handle, size, prop, flags), size, handle, NS_HANDLE, size,
                               KIND_HANDLE);
}

CUresult gs_mem_release(gs_fn_cuMemRelease real, CUmemGenericAllocationHandle handle)
{
    CUresult r = real(handle);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        gs_memtab_handle_released(handle);
    return r;
}

CUresult gs_mem_retain_handle(gs_fn_cuMemRetainAllocationHandle real,
                              CUmemGenericAllocationHandle *handle, void *addr)
{
    CUresult r = real(handle, addr);
    if (r == CUDA_SUCCESS && handle && !gs_config()->disabled)
        gs_memtab_handle_retained(*handle);
    return r;
}

CUresult gs_mem_map(gs_fn_cuMemMap real, CUdeviceptr ptr, size_t size, size_t offset,
                    CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult r = real(ptr, size, offset, handle, flags);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        gs_memtab_handle_mapped(handle, ptr, size);
    return r;
}

CUresult gs_mem_unmap(gs_fn_cuMemUnmap real, CUdeviceptr ptr, size_t size)
{
    CUresult r = real(ptr, size);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        gs_memtab_range_unmapped(ptr, size);
    return r;
}

/* CUDA arrays (textures, surfaces; CuPy's CUDAarray): device memory like any other. The driver
 * pads them; the descriptor's bytes are counted, the padding is within the context estimate. */
static uint64_t element_bytes(int format)
{
    switch (format) {
    case 0x01: case 0x08: return 1; /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2; /* (UN)SIGNED_INT16, HALF */
    default: return 4; /* 32-bit formats, FLOAT, and any newer one counted at 4 per channel */
    }
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, int format, unsigned channels,
                            unsigned levels)
{
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t lw = w >> l ? w >> l : 1, lh = h ? (h >> l ? h >> l : 1) : 1;
        uint64_t ld = d ? (d >> l ? d >> l : 1) : 1;
        total += lw * lh * ld * (channels ? channels : 1) * element_bytes(format);
    }
    return total;
}

static CUresult count_array(CUresult r, uint64_t bytes, const void *handle_slot)
{
    unsigned long long key = r == CUDA_SUCCESS ? (unsigned long long)*(void *const *)handle_slot : 0;
    return gs_memtab_settle(r, bytes, &key, NS_ARRAY, bytes, KIND_DEVICE);
}

CUresult gs_mem_array_create(gs_fn_cuArrayCreate_v2 real, CUarray *pHandle,
                             const CUDA_ARRAY_DESCRIPTOR *desc)
{
    if (gs_config()->disabled || !pHandle || !desc)
        return real(pHandle, desc);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels, 1);
    CUresult r = gs_memtab_reserve(bytes);
    return r != CUDA_SUCCESS ? r : count_array(real(pHandle, desc), bytes, pHandle);
}

CUresult gs_mem_array3d_create(gs_fn_cuArray3DCreate_v2 real, CUarray *pHandle,
                               const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    if (gs_config()->disabled || !pHandle || !desc)
        return real(pHandle, desc);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
                                 desc->NumChannels, 1);
    CUresult r = gs_memtab_reserve(bytes);
    return r != CUDA_SUCCESS ? r : count_array(real(pHandle, desc), bytes, pHandle);
}

CUresult gs_mem_mipmapped_create(gs_fn_cuMipmappedArrayCreate real, CUmipmappedArray *pHandle,
                                 const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels)
{
    if (gs_config()->disabled || !pHandle || !desc)
        return real(pHandle, desc, levels);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
                                 desc->NumChannels, levels);
    CUresult r = gs_memtab_reserve(bytes);
    return r != CUDA_SUCCESS ? r : count_array(real(pHandle, desc, levels), bytes, pHandle);
}

CUresult gs_mem_array_destroy(gs_fn_cuArrayDestroy real, CUarray h)
{
    CUresult r = real(h);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        gs_memtab_uncount((uint64_t)(uintptr_t)h, NS_ARRAY);
    return r;
}

CUresult gs_mem_mipmapped_destroy(gs_fn_cuMipmappedArrayDestroy real, CUmipmappedArray h)
{
    CUresult r = real(h);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        gs_memtab_uncount((uint64_t)(uintptr_t)h, NS_ARRAY);
    return r;
}

CUresult gs_mem_free(gs_fn_cuMemFree_v2 real, CUdeviceptr dptr)
{
    CUresult r;
    if (dptr && !gs_config()->disabled && gs_vmm_free(dptr, &r))
        return r;
    if (dptr && !gs_config()->disabled && gs_graphs_free_unbacked(dptr))
        return CUDA_SUCCESS;
    r = real(dptr);
    if (r == CUDA_SUCCESS && dptr && !gs_config()->disabled) {
        gs_memtab_uncount(dptr, NS_PTR);
        gs_reserves_after_free(); /* cuMemFree of pool memory: the pool may keep it */
    }
    return r;
}

CUresult gs_mem_free_async(gs_fn_cuMemFreeAsync real, CUdeviceptr dptr, CUstream hStream)
{
    CUresult r;
    /* cudaFreeAsync of cudaMalloc memory is legal: freed at once, after a synchronise. */
    if (dptr && !gs_config()->disabled && gs_vmm_free(dptr, &r))
        return r;
    if (dptr && !gs_config()->disabled && gs_graphs_free_unbacked(dptr))
        return CUDA_SUCCESS;
    r = real(dptr, hStream);
    if (r == CUDA_SUCCESS && dptr && !gs_config()->disabled) {
        gs_memtab_uncount(dptr, NS_PTR);
        gs_reserves_after_free(); /* the pool may keep what was freed */
    }
    return r;
}

/* Prefetch device dev's spans to the host (to_host) or back to `dev`, on the private stream, and
 * wait. Marks what moved. A context of `dev` must be current. */
static int move_all(int to_host, CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    typedef CUresult (*stream_sync_fn)(CUstream);
    double t0 = gs_now();
    *bytes_moved = 0;
    *micros = 0;
    CUstream move_stream = prefetch_stream();
    if (!move_stream)
        return -1;
    stream_sync_fn sync = (stream_sync_fn)gs_driver_sym("cuStreamSynchronize");
    gs_fn_cuMemPrefetchAsync_v2 p2 = GS_REAL(cuMemPrefetchAsync_v2);
    gs_fn_cuMemPrefetchAsync p1 = p2 ? NULL : GS_REAL(cuMemPrefetchAsync);
    if (!sync || (!p1 && !p2))
        return -1;

    size_t n;
    struct gs_span *spans = gs_memtab_managed_spans(dev, to_host ? 0 : 1, &n);
    unsigned char *ok = n ? calloc(n, 1) : NULL;
    if (n && (!spans || !ok)) {
        free(spans);
        free(ok);
        return -1;
    }
    CUmemLocation loc = {to_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                         to_host ? 0 : dev};
    for (size_t i = 0; i < n; i++) {
        CUresult r = p2 ? p2(spans[i].ptr, spans[i].size, loc, 0, move_stream)
                        : p1(spans[i].ptr, spans[i].size, to_host ? CU_DEVICE_CPU : dev,
                             move_stream);
        /* A span freed by the program since the snapshot fails here: skip it. */
        ok[i] = r == CUDA_SUCCESS;
    }
    CUresult sr = sync(move_stream);
    *bytes_moved = gs_memtab_mark_moved(spans, ok, n, to_host);
    free(spans);
    free(ok);
    *micros = (uint64_t)((gs_now() - t0) * 1e6);
    return sr == CUDA_SUCCESS ? 0 : -1;
}

/* What the next eviction of each device is to free (0: everything), set from the scheduler's
 * evict_bytes and used once. Only the shim's own thread sets and reads it. */
static uint64_t evict_target[GS_MEM_DEVICES];

void gs_mem_set_evict_target(CUdevice dev, uint64_t bytes)
{
    evict_target[gs_mem_slot(dev)] = bytes;
}

/* Both kinds of movable memory of device `dev`: the engine's explicit blocks, then the program's
 * own managed memory (and cuMemAlloc made managed under GPUSHARE_MEMORY=managed) by prefetch.
 * A partial eviction moves managed memory only when the blocks did not free enough. */
static int move_everything(int to_host, CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    uint64_t b1 = 0, u1 = 0, b2 = 0, u2 = 0, target = 0;
    int r1, r2 = 0;
    if (to_host) {
        target = evict_target[gs_mem_slot(dev)];
        evict_target[gs_mem_slot(dev)] = 0;
        struct gs_vmm_totals before, after;
        gs_vmm_totals(dev, &before);
        r1 = gs_vmm_evict(dev, target, &b1, &u1);
        gs_vmm_totals(dev, &after);
        uint64_t freed = after.evicted - before.evicted;
        if (!target || freed < target)
            r2 = move_all(1, dev, &b2, &u2);
    } else {
        r1 = gs_vmm_restore(dev, &b1, &u1);
        r2 = move_all(0, dev, &b2, &u2);
    }
    *bytes_moved = b1 + b2;
    *micros = u1 + u2;
    return r1 == 0 && r2 == 0 ? 0 : -1;
}

int gs_mem_evict(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    return move_everything(1, dev, bytes_moved, micros);
}

int gs_mem_restore(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    int r = move_everything(0, dev, bytes_moved, micros);
    if (gs_staging_allowance() != UINT64_MAX) /* restored blocks' staging counts again */
        gs_vmm_staging_allowance_changed();
    return r;
}

/* The engine's figures of every device as the last gs_mem_totals_now() read them, and the count
 * of gated calls then (under gs_mem_mu): what it reports while a move holds the engine's lock. */
static struct {
    struct gs_vmm_totals v;
    uint64_t calls;
} last_vmm;

static void totals(CUdevice dev, struct gs_mem_totals *out, int wait)
{
    *out = (struct gs_mem_totals){0};
    gs_mem_account_totals(dev, out);
    struct gs_vmm_totals v;
    struct gs_staging_totals st;
    if (wait) {
        gs_vmm_totals(dev, &v);
    } else {
        uint64_t calls = gs_total_gated_calls();
        int fresh = gs_vmm_totals_try(dev, &v) == 0;
        pthread_mutex_lock(&gs_mem_mu);
        if (fresh) {
            last_vmm.v = v;
            last_vmm.calls = calls;
        } else {
            v = last_vmm.v;
            if (calls != last_vmm.calls) /* a GPU call since makes every pre-copy stale */
                v.precopied_valid = 0;
        }
        pthread_mutex_unlock(&gs_mem_mu);
    }
    gs_staging_totals(&st);
    out->precopied = v.precopied_valid;
    /* Memory shared through CUDA IPC stays on the device while imported: pinned, not evictable. */
    out->managed -= v.ipc_pinned;
    out->pinned += v.ipc_pinned;
    out->staging_pinned = st.pinned_bytes;
    out->staging_pageable = st.pageable_bytes;
    out->staging_fallbacks = st.fallbacks; /* the host's: one budget for every device */
    out->host_bytes = st.pinned_bytes + st.pageable_bytes;
    if (wait)
        out->staging_resident = gs_vmm_resident_staging();
}

void gs_mem_totals_dev(CUdevice dev, struct gs_mem_totals *out) { totals(dev, out, 1); }

void gs_mem_totals_now(struct gs_mem_totals *out) { totals(GS_MEM_ALL_DEVICES, out, 0); }

void gs_mem_precopy_async(CUdevice dev) { gs_vmm_precopy_async(dev); }

void gs_mem_set_staging_allowance(uint64_t bytes)
{
    gs_staging_set_allowance(bytes);
    gs_vmm_staging_allowance_changed();
}

void gs_mem_defer_backing(CUdevice dev)
{
    gs_mem_set_room(dev, 0); /* the grant it was given ended */
    if (gs_config()->memory_mode == GS_MEMORY_VMM)
        gs_vmm_defer_backing(dev);
}

void gs_mem_back_deferred(CUdevice dev)
{
    if (dev == GS_MEM_ALL_DEVICES) /* the process runs without grants from now on */
        gs_mem_set_room(dev, 0);
    gs_vmm_back_deferred(dev, 0);
}

void gs_mem_back_granted(CUdevice dev) { gs_vmm_back_deferred(dev, 1); }

int gs_mem_take_hopeless(CUdevice dev) { return gs_vmm_take_hopeless(1u << gs_mem_slot(dev)) != 0; }

int gs_mem_hopeless(CUdevice dev) { return (gs_vmm_hopeless_bits() >> gs_mem_slot(dev)) & 1u; }

int gs_mem_take_given_up(CUdevice dev) { return gs_vmm_take_given_up(1u << gs_mem_slot(dev)) != 0; }

unsigned gs_mem_past_room(void) { return gs_vmm_past_room_bits(); }

/* At idle, with the application's context current: also what the pools and graphs hold now. */
void gs_mem_prepare_staging(void)
{
    gs_vmm_prepare_staging();
    gs_reserves_refresh();
}

/* A context was destroyed or reset (ctx NULL: a primary context, by its device). What was
 * allocated in it is gone: stop counting it and give back the engine's blocks of it (issue 12,
 * item 4); the private streams that lived in it are dangling and made again when next needed. */
void gs_mem_context_gone(CUcontext ctx)
{
    if (!gs_config()->disabled) {
        gs_vmm_forget_context(ctx);
        if (ctx)
            gs_memtab_forget_context(ctx);
        gs_reserves_context_gone();
    }
    memset(prefetch_streams, 0, sizeof prefetch_streams);
}

/* ---- fork ---- */

void gs_mem_after_fork_child(void)
{
    gs_memtab_after_fork_child();
    gs_mem_account_after_fork_child();
    gs_vmm_after_fork_child();
    gs_vmm_prepare_after_fork_child();
    gs_staging_after_fork_child();
    gs_bounce_after_fork_child();
    memset(evict_target, 0, sizeof evict_target);
    gs_reserves_after_fork_child();
    gs_graphs_after_fork_child();
    memset(prefetch_streams, 0, sizeof prefetch_streams);
}
