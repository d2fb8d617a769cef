/*
 * Checking copies. Two parts: the sampled check every copy into host staging gets (on by default,
 * GPUSHARE_CHECK_COPIES=0 turns it off), and the full check GPUSHARE_VERIFY_MOVES asks for.
 *
 * The sampled check: on an H100, under 32 processes starting at once, a pre-copy into host
 * staging registered just before it came back with its first 4.6-162 MB zero (the device was
 * right; docs/gpu-verification.md, 2026-11-28-b). The same copy outside the shim (a registered
 * buffer, 288 processes) never did, and the cause is not known. A copy out is the only copy of
 * the memory once the block is unmapped, so each is compared with the device in windows of
 * SAMPLE_BYTES (the first at its start, where every damage seen began, the last at its end; up to
 * SAMPLE_WINDOWS for a large block): a few small reads per block. A wrong one is copied again.
 *
 * GPUSHARE_VERIFY_MOVES=1, a diagnostic (off by default): every eviction and restore is checked
 * against the memory it copied, at the cost of reading each block back once or twice.
 *
 * Why: on an H100, a kernel woken from deep idle once read the first 4.4 MiB of its restored 1 GiB
 * tensor as zeros (tests/gpu/test_gpu_deep_idle.py), the rest right. Which step lost it - the copy
 * out, the host copy while the process slept, the copy back, or something writing the device
 * after the copy back - is what these checks say, one warning per step that went wrong:
 *  - before an eviction unmaps a block: the device against its staging (was the copy out, or the
 *    pre-copy an unmap relies on, whole?), then a checksum of the staging is kept;
 *  - before a restore copies back: the staging against that checksum (did the host copy change
 *    while evicted?);
 *  - after the copy back: the device against the staging, at once and again VERIFY_LATER_MS
 *    later (did something write the device after the copy?). A block found wrong is copied back
 *    again and checked once more, so the program goes on with its data.
 * Called under gs_vmm_mu, on the thread that moves, with the block's context current.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vmm.h"

#define VERIFY_PIECE (64ull << 20)
#define VERIFY_LATER_MS 20 /* said as "20 ms later" below */

#define SAMPLE_WINDOWS 16u
#define SAMPLE_BYTES (64u << 10)
#define SAMPLE_SPAN (128ull << 20)

int gs_verify_on(void) { return gs_config()->verify_moves; }

/* Where device and host differ: the first and last differing byte, how many bytes differ, and
 * how many of those read zero on the device (memory never written holds zeros). */
struct diff {
    uint64_t first, last, count, device_zeros;
    int unreadable; /* the read-back failed: nothing is known */
};

static void note_piece(struct diff *d, uint64_t base, const unsigned char *dev,
                       const unsigned char *host, uint64_t len)
{
    if (memcmp(dev, host, len) == 0)
        return;
    for (uint64_t i = 0; i < len; i++) {
        if (dev[i] == host[i])
            continue;
        if (!d->count)
            d->first = base + i;
        d->last = base + i;
        d->count++;
        d->device_zeros += dev[i] == 0;
    }
}

/* Compare the device's `size` bytes at va with host, a piece at a time through one buffer. */
static struct diff compare(CUdeviceptr va, const void *host, uint64_t size, CUstream s)
{
    struct diff d = {0};
    uint64_t piece = size < VERIFY_PIECE ? size : VERIFY_PIECE;
    unsigned char *buf = malloc(piece);
    if (!buf) {
        d.unreadable = 1;
        return d;
    }
    for (uint64_t off = 0; off < size; off += piece) {
        uint64_t len = size - off < piece ? size - off : piece;
        if (gs_vmm_drv.d2h(buf, va + off, len, s) != CUDA_SUCCESS ||
            gs_vmm_drv.stream_sync(s) != CUDA_SUCCESS) {
            d.unreadable = 1;
            break;
        }
        note_piece(&d, off, buf, (const unsigned char *)host + off, len);
    }
    free(buf);
    return d;
}

int gs_check_copy_out(const struct block *b, CUstream s, uint64_t *where)
{
    if (!gs_config()->check_copies)
        return 0;
    uint64_t window = b->size < SAMPLE_BYTES ? b->size : SAMPLE_BYTES;
    /* The start and the end, and one more window per SAMPLE_SPAN up to SAMPLE_WINDOWS: a
     * small block costs two short reads (an eviction of a few hundred blocks stays fast). */
    uint64_t more = b->size / SAMPLE_SPAN;
    unsigned windows = more >= SAMPLE_WINDOWS - 2 ? SAMPLE_WINDOWS : 2 + (unsigned)more;
    for (unsigned w = 0; w < windows; w++) {
        /* Evenly from the start to the end, each window 256-byte aligned. */
        uint64_t off = (b->size - window) * w / (windows - 1) / 256 * 256;
        const unsigned char *host = (const unsigned char *)b->staging.host + off;
        struct diff d = compare(b->va + off, host, window, s);
        if (d.unreadable)
            return -1;
        if (d.count) {
            *where = off;
            return 1;
        }
    }
    return 0;
}

static uint64_t checksum(const void *host, uint64_t size)
{
    const uint64_t *w = host;
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (uint64_t i = 0; i < size / 8; i++)
        h = (h ^ w[i]) * 0x100000001b3ull + (h >> 29);
    const unsigned char *tail = (const unsigned char *)host + size / 8 * 8;
    for (uint64_t i = 0; i < size % 8; i++)
        h = (h ^ tail[i]) * 0x100000001b3ull;
    return h;
}

/* 1 and a warning when d says device and host differ. */
static int say(const struct block *b, const char *step, const struct diff *d)
{
    char a[32];
    if (d->unreadable) {
        GS_WARN("verify %s: block of %s at 0x%llx could not be read back", step,
                gs_format_size(b->size, a, sizeof a), (unsigned long long)b->va);
        return 0;
    }
    if (!d->count)
        return 0;
    GS_WARN("verify %s: block of %s at 0x%llx differs from its host copy: %llu bytes in "
            "[%llu, %llu], %llu of them zero on the device",
            step, gs_format_size(b->size, a, sizeof a), (unsigned long long)b->va,
            (unsigned long long)d->count, (unsigned long long)d->first,
            (unsigned long long)d->last, (unsigned long long)d->device_zeros);
    return 1;
}

void gs_verify_before_unmap(struct block *b, CUstream s)
{
    struct diff d = compare(b->va, b->staging.host, b->size, s);
    say(b, "eviction (device vs its copy, before the unmap)", &d);
    b->verify_sum = checksum(b->staging.host, b->size);
    b->verify_summed = 1;
}

void gs_verify_before_restore(struct block *b)
{
    if (b->verify_summed && checksum(b->staging.host, b->size) != b->verify_sum) {
        char a[32];
        GS_WARN("verify restore: the host copy of the block of %s at 0x%llx changed while it "
                "was evicted",
                gs_format_size(b->size, a, sizeof a), (unsigned long long)b->va);
    }
    b->verify_summed = 0;
}

void gs_verify_after_restore(struct block *b, CUstream s)
{
    struct diff now = compare(b->va, b->staging.host, b->size, s);
    int wrong = say(b, "restore (device vs its copy, after the copy back)", &now);
    struct timespec later = {0, VERIFY_LATER_MS * 1000000L};
    nanosleep(&later, NULL);
    struct diff then = compare(b->va, b->staging.host, b->size, s);
    wrong |= say(b, "restore (device vs its copy, 20 ms later)", &then);
    if (!wrong)
        return;
    if (gs_vmm_drv.h2d(b->va, b->staging.host, b->size, s) != CUDA_SUCCESS ||
        gs_vmm_drv.stream_sync(s) != CUDA_SUCCESS) {
        GS_WARN("verify restore: copying back again failed");
        return;
    }
    struct diff again = compare(b->va, b->staging.host, b->size, s);
    if (!say(b, "restore (after copying back again)", &again)) {
        char a[32];
        GS_WARN("verify restore: the block of %s at 0x%llx is right after copying back again",
                gs_format_size(b->size, a, sizeof a), (unsigned long long)b->va);
    }
}
