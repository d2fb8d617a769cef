/*
 * Draining the application's work safely: the steps that synchronise (a release, an eviction, a
 * restore, the GOODBYE) first wait, bounded, until no stream captures, and hold new captures off
 * while they run, because a synchronisation during a capture fails the user's capture
 * (docs/reliability.md).
 */
#include "session.h"

int gs_drain_quiesce(const char *what, double seconds)
{
    if (gs_capture_hold_off(0))
        return 1;
    GS_INFO("%s waits for a stream capture to end", what);
    double t0 = gs_now();
    if (gs_capture_hold_off(seconds)) {
        GS_INFO("%s went on after the capture ended (%.1f ms)", what, gs_ms(gs_now() - t0));
        return 1;
    }
    GS_WARN("%s: a stream still captures after %.1f s; not synchronising (that would fail the "
            "capture)",
            what, seconds);
    return 0;
}

/* Synchronise and, if asked, move device dev's memory to the host. Returns whether the work
 * drained; *evicted says whether the eviction succeeded. */
int gs_drain_work(struct gs_session *s, const char *what, CUdevice dev, int evict,
                  int every_device, int *evicted, uint64_t *moved, uint64_t *us)
{
    *evicted = 0;
    *moved = *us = 0;
    if (!gs_drain_quiesce(what, gs_config()->capture_wait))
        return 0;
    /* A process that uses several devices holds each on its own (link.c): a revoke waits for
     * that device's work only and evicts that device's memory only (the engine keeps an account
     * per device), unless the program gives every device back (gpushare_release). */
    pthread_mutex_lock(&s->mu);
    int several = s->links.n > 0;
    pthread_mutex_unlock(&s->mu);
    int failed = several && !every_device ? gs_device_sync_dev(s, dev) : gs_device_sync_all(s);
    /* Its memory moves in a context of its own device: the copies run on that device's engines
     * and physical memory is made there again at restore. */
    if (evict && !failed && gs_device_push_on(s, dev) == 0) {
        *evicted = gs_mem_evict(dev, moved, us) == 0;
        gs_device_pop();
    }
    gs_capture_unlock();
    return !failed;
}

/* Bring device dev's evicted memory back (the app's work is not running: no capture waits). */
void gs_drain_restore(struct gs_session *s, const char *what, CUdevice dev, uint64_t *moved,
                      uint64_t *us)
{
    struct gs_mem_totals t;
    gs_mem_totals_dev(dev, &t);
    *moved = *us = 0;
    if (!t.evicted || !gs_drain_quiesce(what, gs_config()->capture_wait))
        return;
    if (gs_device_push_on(s, dev) == 0) {
        gs_mem_restore(dev, moved, us);
        gs_device_pop();
    }
    gs_capture_unlock();
}

int gs_drain_devices(struct gs_session *s, CUdevice *devs)
{
    pthread_mutex_lock(&s->mu);
    int n = 0;
    devs[n++] = s->devs.dev;
    for (int i = 0; i < s->links.n; i++)
        devs[n++] = s->links.l[i].dev;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void gs_drain_restore_every_device(struct gs_session *s, const char *what)
{
    gs_mem_back_deferred(GS_MEM_ALL_DEVICES);
    CUdevice devs[GS_MAX_LINKS + 1];
    int n = gs_drain_devices(s, devs);
    for (int i = 0; i < n; i++) {
        uint64_t moved, us;
        gs_drain_restore(s, what, devs[i], &moved, &us);
    }
}

