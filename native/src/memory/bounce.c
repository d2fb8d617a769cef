/*
 * The bounce ring: a small pinned host buffer (GPUSHARE_BOUNCE_BYTES, default 256 MiB, in four
 * slots) made when the engine's first block is, through which an eviction copies a block whose
 * host staging is not ready (not made yet, or pageable past GPUSHARE_HOST_BUDGET).
 *
 * A device-to-host copy into pageable memory runs at 1.4-2.4 GB/s on an H100 (the driver stages it
 * through its own small pinned buffer, one thread faulting the pages in); into pinned memory at
 * 54 GB/s. So the copy engine fills the ring's slots at the bus's speed while the engine's CPU
 * workers (memory/workers.c) copy each filled slot out into the block's pageable staging side by
 * side, faulting its huge pages in as they go: the slower of the two sets the pace, and several
 * cores keep up with the bus where one cannot.
 *
 * One eviction uses the ring at a time (its own lock); the preparer never does.
 */
#include <string.h>
#include <sys/mman.h>

#include "vmm.h"

#define SLOTS 4u

typedef CUresult (*host_register_fn)(void *, size_t, unsigned int);

static pthread_mutex_t ring_mu = PTHREAD_MUTEX_INITIALIZER;
static char *ring;
static uint64_t slot_bytes;
static int ring_tried;
static uint64_t bounced_bytes; /* what evictions copied through the ring, for the log and tests */

void gs_bounce_prepare(void)
{
    pthread_mutex_lock(&ring_mu);
    uint64_t want = gs_config()->bounce_bytes / SLOTS / 4096 * 4096;
    if (ring_tried || !want) {
        ring_tried = 1;
        pthread_mutex_unlock(&ring_mu);
        return;
    }
    ring_tried = 1;
    host_register_fn reg = (host_register_fn)gs_driver_sym("cuMemHostRegister_v2");
    char *p = mmap(NULL, want * SLOTS, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p != MAP_FAILED && reg && reg(p, want * SLOTS, GS_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS) {
        ring = p;
        slot_bytes = want;
    } else {
        if (p != MAP_FAILED)
            munmap(p, want * SLOTS);
        GS_INFO("no pinned bounce ring: an eviction before its staging is ready copies through "
                "pageable memory");
    }
    pthread_mutex_unlock(&ring_mu);
}

struct spill {
    char *dst;
    const char *src;
    uint64_t len;
    unsigned parts;
};

static void spill_part(void *arg, unsigned i)
{
    const struct spill *sp = arg;
    uint64_t each = (sp->len / sp->parts + 4095) / 4096 * 4096;
    uint64_t off = (uint64_t)i * each;
    if (off < sp->len)
        memcpy(sp->dst + off, sp->src + off, sp->len - off < each ? sp->len - off : each);
}

static int queue_slot(unsigned k, CUdeviceptr src, uint64_t off, uint64_t size, CUstream s,
                      CUevent ev)
{
    uint64_t len = size - off < slot_bytes ? size - off : slot_bytes;
    if (gs_vmm_drv.d2h(ring + (uint64_t)k * slot_bytes, src + off, len, s) != CUDA_SUCCESS)
        return -1;
    return gs_vmm_drv.event_record(ev, s) == CUDA_SUCCESS ? 0 : -1;
}

int gs_bounce_copy_out(void *dst, CUdeviceptr src, uint64_t size, CUstream s, int (*stop)(void))
{
    pthread_mutex_lock(&ring_mu);
    if (!ring) {
        pthread_mutex_unlock(&ring_mu);
        return 1;
    }
    CUevent ev[SLOTS] = {0};
    int failed = 0;
    for (unsigned k = 0; k < SLOTS && !failed; k++)
        failed = gs_vmm_drv.event_create(&ev[k], GS_EVENT_DISABLE_TIMING) != CUDA_SUCCESS;
    uint64_t chunks = (size + slot_bytes - 1) / slot_bytes;
    for (uint64_t c = 0; c < chunks && c < SLOTS && !failed; c++)
        failed = queue_slot((unsigned)c, src, c * slot_bytes, size, s, ev[c]) != 0;
    int stopped = 0;
    for (uint64_t c = 0; c < chunks && !failed; c++) {
        unsigned k = (unsigned)(c % SLOTS);
        if (c > 0 && stop && stop()) {
            stopped = 1;
            break;
        }
        if (gs_vmm_drv.event_sync(ev[k]) != CUDA_SUCCESS) {
            failed = 1;
            break;
        }
        uint64_t off = c * slot_bytes;
        struct spill sp = {.dst = (char *)dst + off,
                           .src = ring + (uint64_t)k * slot_bytes,
                           .len = size - off < slot_bytes ? size - off : slot_bytes,
                           .parts = gs_workers_count()};
        gs_workers_run(spill_part, &sp, sp.parts);
        if (c + SLOTS < chunks) /* the slot is free again: the copy engine refills it */
            failed = queue_slot(k, src, (c + SLOTS) * slot_bytes, size, s, ev[k]) != 0;
    }
    if (failed || stopped) /* nothing of ours may still write the ring when the next user takes it */
        gs_vmm_drv.stream_sync(s);
    for (unsigned k = 0; k < SLOTS; k++)
        if (ev[k])
            gs_vmm_drv.event_destroy(ev[k]);
    if (!failed && !stopped)
        bounced_bytes += size;
    pthread_mutex_unlock(&ring_mu);
    return failed ? -1 : stopped ? 2 : 0;
}

uint64_t gs_bounce_total(void)
{
    pthread_mutex_lock(&ring_mu);
    uint64_t n = bounced_bytes;
    pthread_mutex_unlock(&ring_mu);
    return n;
}

void gs_bounce_after_fork_child(void)
{
    /* The ring is registered in the parent's context, absent in the child: the child makes its
     * own (the parent's pages stay mapped, copy-on-write, and are left alone). */
    pthread_mutex_init(&ring_mu, NULL);
    ring = NULL;
    slot_bytes = 0;
    ring_tried = 0;
    bounced_bytes = 0;
}
