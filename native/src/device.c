/*
 * The application's contexts and devices, and the driver functions the shim calls on them itself
 * (never hooked ones: those would gate the gatekeeper).
 */
#include <stdio.h>
#include <string.h>

#include "session.h"

static struct {
    CUresult (*ctx_push)(CUcontext);
    CUresult (*ctx_pop)(CUcontext *);
    CUresult (*ctx_sync)(void);
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_get_device)(CUdevice *);
    CUresult (*primary_state)(CUdevice, unsigned int *, int *);
    CUresult (*uuid_v2)(CUuuid *, CUdevice);
    CUresult (*uuid)(CUuuid *, CUdevice);
    CUresult (*name)(char *, int, CUdevice);
    CUresult (*total_mem)(size_t *, CUdevice);
} D;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void load_driver_fns(void)
{
    *(void **)&D.ctx_push = gs_driver_sym("cuCtxPushCurrent_v2");
    *(void **)&D.ctx_pop = gs_driver_sym("cuCtxPopCurrent_v2");
    *(void **)&D.ctx_sync = gs_driver_sym("cuCtxSynchronize");
    *(void **)&D.ctx_get_current = gs_driver_sym("cuCtxGetCurrent");
    *(void **)&D.ctx_get_device = gs_driver_sym("cuCtxGetDevice");
    *(void **)&D.primary_state = gs_driver_sym("cuDevicePrimaryCtxGetState");
    *(void **)&D.uuid_v2 = gs_driver_sym("cuDeviceGetUuid_v2");
    *(void **)&D.uuid = gs_driver_sym("cuDeviceGetUuid");
    *(void **)&D.name = gs_driver_sym("cuDeviceGetName");
    *(void **)&D.total_mem = gs_driver_sym("cuDeviceTotalMem_v2");
}

static void drv(void) { pthread_once(&drv_once, load_driver_fns); }

int gs_device_note_context_locked(struct gs_session *s, CUcontext ctx, CUdevice dev, int primary)
{
    if (s->started || s->quitting) {
        if (!s->devs.ctx) { /* the context we knew was destroyed: follow the new one */
            s->devs.ctx = ctx;
            s->devs.dev = dev;
            s->devs.ctx_is_primary = primary;
        }
        return 0;
    }
    s->started = 1;
    s->devs.ctx = ctx;
    s->devs.dev = dev;
    s->devs.ctx_is_primary = primary;
    return 1;
}

void gs_device_forget_context(struct gs_session *s, CUcontext ctx)
{
    pthread_mutex_lock(&s->mu);
    if (s->devs.ctx == ctx)
        s->devs.ctx = NULL;
    pthread_mutex_unlock(&s->mu);
}

int gs_device_current(CUcontext *ctx, CUdevice *dev)
{
    drv();
    *ctx = NULL;
    *dev = 0;
    if (D.ctx_get_current && D.ctx_get_current(ctx) == CUDA_SUCCESS && *ctx &&
        D.ctx_get_device && D.ctx_get_device(dev) == CUDA_SUCCESS)
        return 0;
    return -1;
}

int gs_device_push(struct gs_session *s, CUdevice *dev_out)
{
    drv();
    pthread_mutex_lock(&s->mu);
    CUcontext ctx = s->devs.ctx;
    CUdevice dev = s->devs.dev;
    int primary = s->devs.ctx_is_primary;
    pthread_mutex_unlock(&s->mu);
    if (dev_out)
        *dev_out = dev;
    if (!ctx || !D.ctx_push || !D.ctx_pop)
        return -1;
    if (primary && D.primary_state) {
        /* The program may have released its primary context: never push a dead one. */
        unsigned int flags = 0;
        int active = 0;
        if (D.primary_state(dev, &flags, &active) != CUDA_SUCCESS || !active)
            return -1;
    }
    return D.ctx_push(ctx) == CUDA_SUCCESS ? 0 : -1;
}

void gs_device_pop(void)
{
    CUcontext ignored;
    D.ctx_pop(&ignored);
}

void gs_device_sync_current(void)
{
    if (D.ctx_sync)
        D.ctx_sync();
}

void gs_device_sync_all(struct gs_session *s)
{
    /* Errors (a context already gone at exit) are tolerated: nothing is left to wait for then. */
    if (gs_device_push(s, NULL) != 0)
        return;
    gs_device_sync_current();
    gs_device_pop();
}

void gs_device_identify(struct gs_session *s, CUdevice dev)
{
    drv();
    CUuuid u;
    memset(&u, 0, sizeof u);
    if ((D.uuid_v2 && D.uuid_v2(&u, dev) == CUDA_SUCCESS) ||
        (D.uuid && D.uuid(&u, dev) == CUDA_SUCCESS)) {
        const unsigned char *b = (const unsigned char *)u.bytes;
        snprintf(s->devs.uuid, sizeof s->devs.uuid,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
    }
    if (!D.name || D.name(s->devs.name, (int)sizeof s->devs.name, dev) != CUDA_SUCCESS)
        s->devs.name[0] = 0;
    s->devs.name[sizeof s->devs.name - 1] = 0;
    size_t total = 0;
    if (D.total_mem && D.total_mem(&total, dev) == CUDA_SUCCESS)
        s->devs.total = total;
}
