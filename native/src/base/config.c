/*
 * Configuration from the environment, read once (lazily: the shim is preloaded into every process
 * of a session, most of which never touch CUDA, so nothing is done before it is needed).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

static struct gs_config g_config;
static pthread_once_t g_config_once = PTHREAD_ONCE_INIT;

double gs_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int gs_parse_size(const char *text, uint64_t *out)
{
    /* Same grammar as jupyter_gpushare/units.py: a number (decimals allowed), an optional unit,
     * every unit 1024-based whatever its spelling (G, GB and GiB all mean 2**30). */
    static const struct {
        const char *unit;
        uint64_t mult;
    } units[] = {
        {"", 1},           {"b", 1},           {"k", 1ull << 10},  {"kb", 1ull << 10},
        {"kib", 1ull << 10}, {"m", 1ull << 20}, {"mb", 1ull << 20}, {"mib", 1ull << 20},
        {"g", 1ull << 30}, {"gb", 1ull << 30}, {"gib", 1ull << 30}, {"t", 1ull << 40},
        {"tb", 1ull << 40}, {"tib", 1ull << 40},
    };
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    uint64_t whole = 0, frac_num = 0, frac_den = 1;
    int digits = 0;
    while (isdigit((unsigned char)*p)) {
        uint64_t digit = (uint64_t)(*p++ - '0');
        if (whole > (UINT64_MAX - digit) / 10) /* exact: 18446744073709551615 still parses */
            return -1;
        whole = whole * 10 + digit;
        digits++;
    }
    if (*p == '.') {
        p++;
        while (isdigit((unsigned char)*p)) {
            if (frac_den < 1000000000000ull) { /* more precision than any size needs */
                frac_num = frac_num * 10 + (uint64_t)(*p - '0');
                frac_den *= 10;
            }
            p++;
            digits++;
        }
    }
    if (!digits)
        return -1;
    while (isspace((unsigned char)*p))
        p++;
    char unit[8] = {0};
    size_t n = 0;
    while (isalpha((unsigned char)*p) && n < sizeof unit - 1)
        unit[n++] = (char)tolower((unsigned char)*p++);
    while (isspace((unsigned char)*p))
        p++;
    if (*p)
        return -1;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(unit, units[i].unit) == 0) {
            uint64_t mult = units[i].mult;
            if (whole && mult > UINT64_MAX / whole)
                return -1;
            /* frac_num < frac_den <= 1e12 and mult <= 2**40: the product fits in 128 bits only,
             * so divide first where it is exact enough (sizes are not measured in picobytes). */
            unsigned __int128 frac = (unsigned __int128)frac_num * mult / frac_den;
            /* whole * mult fits (checked above), the fraction may not fit beside it: 16777215.99T
             * would wrap to a few bytes and become a tiny quota instead of an error. */
            if ((uint64_t)frac > UINT64_MAX - whole * mult)
                return -1;
            *out = whole * mult + (uint64_t)frac;
            return 0;
        }
    }
    return -1;
}

int gs_forgotten_unit(const char *text, uint64_t bytes)
{
    /* jupyter_gpushare/units.py's parse_memory_size: a number without a unit, above 0 and below
     * 1 MiB, is a forgotten unit (GPUSHARE_MEMORY_LIMIT=24 meant 24GiB), not a quota of 24 bytes. */
    if (bytes >= GS_BARE_NUMBER_FLOOR)
        return 0;
    int nonzero = 0;
    for (const char *p = text; *p; p++) {
        if (isalpha((unsigned char)*p))
            return 0;
        if (*p >= '1' && *p <= '9')
            nonzero = 1;
    }
    return nonzero;
}

const char *gs_format_size(uint64_t bytes, char *buf, size_t len)
{
    static const char *names[] = {"KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) {
        snprintf(buf, len, "%llu B", (unsigned long long)bytes);
        return buf;
    }
    double v = (double)bytes;
    int i = -1;
    while (v >= 1024.0 && i < 3) {
        v /= 1024.0;
        i++;
    }
    snprintf(buf, len, "%.2f %s", v, names[i]);
    return buf;
}

static const char *env(const char *name)
{
    const char *v = getenv(name);
    return (v && *v) ? v : NULL;
}

/* Half the machine's memory: staging mirrors device memory on the host, and the host must keep
 * room for the programs themselves. */
static uint64_t default_host_budget(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page / 2 : 0;
}

/* A duration in seconds from the environment (0 <= s < 1e6); a bad value keeps the default. */
static void env_seconds(const char *name, double *out, const char *expected)
{
    const char *v = env(name);
    if (!v)
        return;
    char *end;
    double s = strtod(v, &end);
    if (end != v && !*end && s >= 0 && s < 1e6)
        *out = s;
    else
        GS_WARN("ignoring %s=%s: expected %s", name, v, expected);
}

/* A whole number lo..hi from the environment: 1 when set and valid (a bad value is said). */
static int env_long(const char *name, long lo, long hi, long *out)
{
    const char *v = env(name);
    if (!v)
        return 0;
    char *end;
    long n = strtol(v, &end, 10);
    if (end != v && !*end && n >= lo && n <= hi) {
        *out = n;
        return 1;
    }
    GS_WARN("ignoring %s=%s: expected %ld to %ld", name, v, lo, hi);
    return 0;
}

static void load_config(void)
{
    struct gs_config *c = &g_config;
    c->log_level = gs_log_level_now(); /* log.c reads GPUSHARE_LOG itself: it sits below */
    c->memory_mode = GS_MEMORY_VMM;
    c->host_budget = default_host_budget();
    c->context_bytes = 536870912ull;
    c->weight_milli = 1000;
    c->idle_seconds = 2.0;
    c->reconnect_wait = 10.0;
    c->capture_wait = 10.0;
    c->real_libcuda = "libcuda.so.1";
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    c->staging_threads = cpus >= 16 ? 8 : cpus >= 2 ? (unsigned)cpus / 2 : 1;
    c->staging_quiet = 0.1;
    c->staging_nice = 0;
    c->check_copies = 1;
    c->bounce_bytes = 0; /* opt-in: see docs/architecture.md, "Cold evictions" */

    const char *v;
    if ((v = env("GPUSHARE_DISABLE")) && strcmp(v, "0") != 0)
        c->disabled = 1;
    if ((v = env("GPUSHARE_MANAGED")) && strcmp(v, "0") == 0) {
        /* The old switch: GPUSHARE_MANAGED=0 meant plain device memory, counted, never moved. */
        c->memory_mode = GS_MEMORY_DEVICE;
    }
    if ((v = env("GPUSHARE_MEMORY"))) {
        if (!strcasecmp(v, "vmm"))
            c->memory_mode = GS_MEMORY_VMM;
        else if (!strcasecmp(v, "managed"))
            c->memory_mode = GS_MEMORY_MANAGED;
        else if (!strcasecmp(v, "device"))
            c->memory_mode = GS_MEMORY_DEVICE;
        else
            GS_WARN("ignoring GPUSHARE_MEMORY=%s: expected vmm, managed or device", v);
    }
    if ((v = env("GPUSHARE_HOST_BUDGET")) && gs_parse_size(v, &c->host_budget) != 0) {
        c->host_budget = default_host_budget();
        GS_WARN("ignoring GPUSHARE_HOST_BUDGET=%s: expected bytes or a size (0 = no pinned "
                "staging)",
                v);
    }
    if ((v = env("GPUSHARE_MEMORY_LIMIT")) && gs_parse_size(v, &c->quota) != 0) {
        c->quota = 0;
        GS_WARN("ignoring GPUSHARE_MEMORY_LIMIT=%s: expected bytes or a size such as 8GiB", v);
    } else if (v && gs_forgotten_unit(v, c->quota)) {
        c->quota = 0;
        GS_WARN("ignoring GPUSHARE_MEMORY_LIMIT=%s: a number without a unit is bytes, too few for "
                "GPU memory; did you mean %sGiB?",
                v, v);
    }
    if ((v = env("GPUSHARE_CONTEXT_BYTES")) && gs_parse_size(v, &c->context_bytes) != 0) {
        c->context_bytes = 536870912ull;
        GS_WARN("ignoring GPUSHARE_CONTEXT_BYTES=%s: expected bytes or a size", v);
    }
    if ((v = env("GPUSHARE_WEIGHT"))) {
        char *end;
        double w = strtod(v, &end);
        if (end != v && !*end && w > 0 && w < 1e6)
            /* w > 0: adding 0.5 rounds. Not llround(): the shim does not link libm, and a
             * program without it died of an undefined symbol when GPUSHARE_WEIGHT was set. */
            c->weight_milli = (uint64_t)(w * 1000.0 + 0.5);
        else
            GS_WARN("ignoring GPUSHARE_WEIGHT=%s: expected a positive number", v);
    }
    env_seconds("GPUSHARE_IDLE_SECONDS", &c->idle_seconds, "seconds (0 = off)");
    env_seconds("GPUSHARE_RECONNECT_WAIT", &c->reconnect_wait, "seconds (0 = unshared at once)");
    env_seconds("GPUSHARE_CAPTURE_WAIT", &c->capture_wait, "seconds");
    if ((v = env("GPUSHARE_REAL_LIBCUDA")))
        c->real_libcuda = v;
    env_seconds("GPUSHARE_STAGING_QUIET", &c->staging_quiet, "seconds (0 = at once)");
    long n;
    if (env_long("GPUSHARE_STAGING_THREADS", 1, 64, &n))
        c->staging_threads = (unsigned)n;
    if (env_long("GPUSHARE_STAGING_NICE", 0, 19, &n))
        c->staging_nice = (int)n;
    if ((v = env("GPUSHARE_BOUNCE_BYTES")) && gs_parse_size(v, &c->bounce_bytes) != 0) {
        c->bounce_bytes = 0;
        GS_WARN("ignoring GPUSHARE_BOUNCE_BYTES=%s: expected bytes or a size (0 = no ring)", v);
    }
    if (env_long("GPUSHARE_VERIFY_MOVES", 0, 1, &n))
        c->verify_moves = (int)n;
    if (env_long("GPUSHARE_CHECK_COPIES", 0, 1, &n))
        c->check_copies = (int)n;
}

const struct gs_config *gs_config(void)
{
    pthread_once(&g_config_once, load_config);
    return &g_config;
}
