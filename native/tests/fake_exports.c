/*
 * The stand-in driver's test-only exports: fakecuda_call_count, the resident bytes, the stats
 * document (fakecuda_stats_json, GPUSHARE_FAKE_STATS_FILE at exit) (included by fake_libcuda.c,
 * which owns the counters this file reads; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Test-only exports                                                                            */
/* ------------------------------------------------------------------------------------------ */

unsigned long fakecuda_call_count(const char *name) {
    unsigned long n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_nfn; i++)
        if (strcmp(g_fn_names[i], name) == 0) n = __atomic_load_n(&g_fn_counts[i], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* The resident bytes the device would report (used by the fake NVML through dlsym). */
unsigned long long fakecuda_device_used_bytes(void) {
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_live_device_bytes + g_live_managed_bytes - g_managed_on_host_bytes;
    pthread_mutex_unlock(&g_lock);
    return used;
}

/* What physical device `phys` holds of this process's (0 for a device that does not exist). */
unsigned long long fakecuda_resident_bytes(int phys) {
    if (phys < 0 || phys >= fk_ndev()) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long r = g_dev_resident[phys];
    pthread_mutex_unlock(&g_lock);
    return r;
}

int fakecuda_stats_json(char *buf, size_t n) {
    char tmp[16384];
    size_t off = 0;
#define APPEND(...)                                                                              \
    do {                                                                                         \
        int w_ = snprintf(tmp + off, off < sizeof(tmp) ? sizeof(tmp) - off : 0, __VA_ARGS__);    \
        if (w_ > 0) off += (size_t)w_;                                                           \
    } while (0)
    pthread_mutex_lock(&g_lock);
    APPEND("{\"calls\":{");
    int first = 1;
    for (int i = 0; i < g_nfn; i++) {
        unsigned long c = __atomic_load_n(&g_fn_counts[i], __ATOMIC_RELAXED);
        if (!c) continue;
        APPEND("%s\"%s\":%lu", first ? "" : ",", g_fn_names[i], c);
        first = 0;
    }
    unsigned long by_kind[6] = {0};
    for (size_t i = 0; i < g_nalloc; i++) by_kind[g_allocs[i].kind]++;
    APPEND("},\"launches\":%lu,\"graph_launches\":%lu,\"kernels\":{\"sleep\":%lu,\"saxpy\":%lu,"
           "\"noop\":%lu},",
           g_launches, g_graph_launches, g_kernel_counts[K_SLEEP], g_kernel_counts[K_SAXPY],
           g_kernel_counts[K_NOOP]);
    APPEND("\"prefetch_to_host_bytes\":%llu,\"prefetch_to_device_bytes\":%llu,"
           "\"prefetch_to_host_calls\":%lu,\"prefetch_to_device_calls\":%lu,"
           "\"fault_to_device_bytes\":%llu,",
           g_prefetch_to_host_bytes, g_prefetch_to_device_bytes, g_prefetch_to_host_calls,
           g_prefetch_to_device_calls, g_fault_to_device_bytes);
    FK_VMM_STATS(APPEND);
    FK_ASYNC_STATS(APPEND);
    FK_GRAPH_STATS(APPEND);
    APPEND("\"live_device_bytes\":%llu,\"live_managed_bytes\":%llu,\"managed_on_host_bytes\":%llu,"
           "\"peak_device_bytes\":%llu,\"device_total\":%llu,\"live_handles\":%zu,\"live_maps\":%zu,"
           "\"live_allocations\":{",
           g_live_device_bytes, g_live_managed_bytes, g_managed_on_host_bytes, g_peak_device_bytes,
           fk_device_total(), g_nhandles, g_nmaps);
    for (int k = 0; k < 6; k++) APPEND("%s\"%s\":%lu", k ? "," : "", kind_names[k], by_kind[k]);
    int refs = 0;
    for (int d = 0; d < FK_MAX_DEV; d++) refs += g_primary_refs[d];
    APPEND("},\"primary_ctx_refs\":%d,\"device_resident_bytes\":[", refs);
    for (int d = 0; d < fk_ndev(); d++) APPEND("%s%llu", d ? "," : "", g_dev_resident[d]);
    APPEND("],");
    APPEND("\"captures\":{\"ended\":%lu,\"invalidated\":%lu,\"unsafe_calls\":%lu,"
           "\"captured_launches\":%lu}}",
           g_captures_ended, g_captures_invalidated, g_capture_unsafe_calls, g_captured_launches);
    pthread_mutex_unlock(&g_lock);
#undef APPEND
    if (off >= sizeof(tmp)) off = sizeof(tmp) - 1;
    if (buf && n) {
        size_t c = off < n - 1 ? off : n - 1;
        memcpy(buf, tmp, c);
        buf[c] = 0;
    }
    return (int)off;
}

__attribute__((destructor)) static void fk_write_stats_at_exit(void) {
    const char *path = getenv("GPUSHARE_FAKE_STATS_FILE");
    if (!path || !*path) return;
    char buf[16384];
    fakecuda_stats_json(buf, sizeof(buf));
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "%s\n", buf);
    fclose(f);
}
