/*
 * The process's view of memory: cuMemGetInfo and NVML report the process's quota (or the pool)
 * as its total and its own use as used, and explicit memory answers cuMemGetAddressRange for its
 * own allocations.
 */
#include "memory.h"

CUresult gs_mem_get_address_range(gs_fn_cuMemGetAddressRange_v2 real, CUdeviceptr *pbase,
                                  size_t *psize, CUdeviceptr dptr)
{
    CUdeviceptr base;
    size_t size;
    if (gs_config()->disabled || !gs_vmm_range(dptr, &base, &size))
        return real(pbase, psize, dptr);
    if (pbase)
        *pbase = base;
    if (psize)
        *psize = size;
    return CUDA_SUCCESS;
}

CUresult gs_mem_device_total(gs_fn_cuDeviceTotalMem_v2 real, size_t *bytes, CUdevice dev)
{
    CUresult r = real(bytes, dev);
    if (r != CUDA_SUCCESS || gs_config()->disabled || !bytes)
        return r;
    uint64_t t, f, u;
    gs_mem_view(*bytes, &t, &f, &u);
    *bytes = (size_t)t;
    return r;
}

CUresult gs_mem_get_info(gs_fn_cuMemGetInfo_v2 real, size_t *free, size_t *total)
{
    CUresult r = real(free, total);
    if (r != CUDA_SUCCESS || gs_config()->disabled || !free || !total)
        return r;
    uint64_t t, f, u;
    gs_mem_view(*total, &t, &f, &u);
    *total = (size_t)t;
    *free = (size_t)f;
    return r;
}

/* NVML inside this process reports the same view, for the device this process's context is on
 * only (a process without a context, such as nvidia-smi, sees the real numbers). */
static int nvml_applies(nvmlDevice_t device)
{
    if (gs_config()->disabled || !gs_client_has_context())
        return 0;
    typedef nvmlReturn_t (*uuid_fn)(nvmlDevice_t, char *, unsigned int);
    uuid_fn get_uuid = (uuid_fn)gs_nvml_sym("nvmlDeviceGetUUID");
    char uuid[96];
    if (!get_uuid || get_uuid(device, uuid, sizeof uuid) != NVML_SUCCESS)
        return 1; /* cannot tell: assume the one device this process uses */
    return gs_client_device_matches_uuid(uuid);
}

nvmlReturn_t gs_nvml_memory_info(gs_fn_nvmlDeviceGetMemoryInfo real, nvmlDevice_t device,
                                 nvmlMemory_t *memory)
{
    nvmlReturn_t r = real(device, memory);
    if (r != NVML_SUCCESS || !memory || !nvml_applies(device))
        return r;
    uint64_t t, f, u;
    gs_mem_view(memory->total, &t, &f, &u);
    memory->total = t;
    memory->free = f;
    memory->used = u < t ? u : t;
    return r;
}

nvmlReturn_t gs_nvml_memory_info_v2(gs_fn_nvmlDeviceGetMemoryInfo_v2 real, nvmlDevice_t device,
                                    nvmlMemory_v2_t *memory)
{
    nvmlReturn_t r = real(device, memory);
    if (r != NVML_SUCCESS || !memory || !nvml_applies(device))
        return r;
    uint64_t t, f, u;
    gs_mem_view(memory->total, &t, &f, &u);
    memory->total = t;
    memory->reserved = 0; /* the driver's reservation is inside our context estimate */
    memory->free = f;
    memory->used = u < t ? u : t;
    return r;
}

