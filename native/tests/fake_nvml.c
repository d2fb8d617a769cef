/*
 * The NVML stand-in (fake_libcuda.c built with -DGPUSHARE_FAKE_NVML, as libnvidia-ml.so.1): every
 * physical device, used memory read from the fake driver, or with GPUSHARE_FAKE_CARD_FILE from the
 * card every process accounts in, which also lists the processes on each device
 * (nvmlDeviceGetComputeRunningProcesses; without a card file: NVML_ERROR_NOT_SUPPORTED)
 * (included by fake_libcuda.c; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* The NVML stand-in: every physical device (NVML ignores CUDA_VISIBLE_DEVICES), the fake      */
/* driver's resident bytes as used on the device this process's context is on.                */
/* ------------------------------------------------------------------------------------------ */

struct nvmlDevice_st {
    int index;
};
static struct nvmlDevice_st g_nvml_devs[FK_MAX_DEV] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static int g_nvml_inited;

enum {
    FK_NVML_ERROR_UNINITIALIZED = 1,
    FK_NVML_ERROR_INVALID_ARGUMENT = 2,
    FK_NVML_ERROR_NOT_FOUND = 6,
    FK_NVML_ERROR_INSUFFICIENT_SIZE = 7,
};

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} fk_nvmlUtilization_t;

static void *fk_driver_sym(const char *name) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym = lib ? dlsym(lib, name) : NULL;
    if (lib) dlclose(lib); /* NOLOAD: only drops the reference just taken; the symbol stays */
    return sym;
}

static unsigned long long nvml_used(int index) {
    /* With a card file: every process's bytes on the device, and what is held outside them. */
    if (fk_card()) return fk_card_used(fk_card(), index) + fk_other_bytes();
    unsigned long long (*used)(void) =
        (unsigned long long (*)(void))fk_driver_sym("fakecuda_device_used_bytes");
    int (*phys)(void) = (int (*)(void))fk_driver_sym("fakecuda_physical_device");
    if (!used || (phys ? phys() : 0) != index) return 0;
    return used();
}

static int nvml_dev_ok(nvmlDevice_t device) {
    return device && device >= &g_nvml_devs[0] && device < &g_nvml_devs[fk_ndev()];
}

nvmlReturn_t nvmlInit_v2(void) {
    g_nvml_inited = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) {
    g_nvml_inited = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    g_nvml_inited = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    g_nvml_inited = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!count) return FK_NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)fk_ndev();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)fk_ndev()) return FK_NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_nvml_devs[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return FK_NVML_ERROR_INVALID_ARGUMENT;
    for (int d = 0; d < fk_ndev(); d++) {
        char u[64];
        fk_phys_uuid_string(d, u, sizeof u);
        if (strcasecmp(u, uuid) == 0) {
            *device = &g_nvml_devs[d];
            return NVML_SUCCESS;
        }
    }
    return FK_NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !index) return FK_NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !uuid) return FK_NVML_ERROR_INVALID_ARGUMENT;
    char u[64];
    fk_phys_uuid_string(device->index, u, sizeof u);
    if (length <= strlen(u)) return FK_NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, u, strlen(u) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !name || !length) return FK_NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, length, "%s", "gpushare stand-in GPU");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, fk_nvmlUtilization_t *util) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !util) return FK_NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = 0;
    util->memory = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !memory) return FK_NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = fk_phys_total(device->index), used = nvml_used(device->index);
    if (used > total) used = total;
    memory->total = total;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !memory) return FK_NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = fk_phys_total(device->index), used = nvml_used(device->index);
    if (used > total) used = total;
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

/* nvmlProcessInfo_v1_t, and v2 (= v3): what nvmlDeviceGetComputeRunningProcesses* fill. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} fk_nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;     /* 0xFFFFFFFF: no MIG */
    unsigned int computeInstanceId; /* 0xFFFFFFFF: no MIG */
} fk_nvmlProcessInfo_v2_t;

enum { FK_NVML_ERROR_NOT_SUPPORTED = 3 };

/* The processes holding memory on `device` (from the card file), into `infos` (v1 or v2 rows):
 * *count in, room; out, how many there are (NVML_ERROR_INSUFFICIENT_SIZE when more than room). */
static nvmlReturn_t nvml_processes(nvmlDevice_t device, unsigned int *count, void *infos, int v2) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !count || (*count && !infos)) return FK_NVML_ERROR_INVALID_ARGUMENT;
    struct fk_card *c = fk_card();
    if (!c) return FK_NVML_ERROR_NOT_SUPPORTED;
    unsigned int room = *count, n = 0;
    fk_card_lock(c);
    fk_card_reap_locked(c);
    for (int i = 0; i < FK_CARD_SLOTS; i++) {
        struct fk_card_slot *s = &c->slot[i];
        if (!s->pid || !s->dev[device->index]) continue;
        if (n < room && v2)
            ((fk_nvmlProcessInfo_v2_t *)infos)[n] = (fk_nvmlProcessInfo_v2_t){
                (unsigned int)s->pid, s->dev[device->index], 0xFFFFFFFFu, 0xFFFFFFFFu};
        else if (n < room)
            ((fk_nvmlProcessInfo_v1_t *)infos)[n] =
                (fk_nvmlProcessInfo_v1_t){(unsigned int)s->pid, s->dev[device->index]};
        n++;
    }
    fk_card_unlock(c);
    *count = n;
    return n > room ? FK_NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                  fk_nvmlProcessInfo_v1_t *infos) {
    return nvml_processes(device, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                     fk_nvmlProcessInfo_v2_t *infos) {
    return nvml_processes(device, count, infos, 1);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     fk_nvmlProcessInfo_v2_t *infos) {
    return nvml_processes(device, count, infos, 1);
}
