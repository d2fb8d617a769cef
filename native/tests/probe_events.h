/*
 * The test programs' output (shim_probe.c, reserves_probe.c): one JSON object per line, as
 * tests/conftest.py's parse_events reads them.
 */
#ifndef GPUSHARE_PROBE_EVENTS_H
#define GPUSHARE_PROBE_EVENTS_H

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* {"event":EVENT,"t_mono":...,"pid":...<fmt's text>}: fmt starts with a comma, or is NULL. */
static void emit(const char *event, const char *fmt, ...)
{
    char body[2048] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(body, sizeof body, fmt, ap);
        va_end(ap);
    }
    printf("{\"event\":\"%s\",\"t_mono\":%.6f,\"pid\":%d%s}\n", event, now(), (int)getpid(), body);
    fflush(stdout);
}

/* The stand-in driver's stats document, as {"event":"stats","stats":{...}}. */
static void emit_stats(void)
{
    int (*f)(char *, size_t) = (int (*)(char *, size_t))dlsym(RTLD_DEFAULT, "fakecuda_stats_json");
    int n = f ? f(NULL, 0) : 0;
    char *buf = n > 0 ? malloc((size_t)n + 1) : NULL;
    if (!buf)
        return;
    f(buf, (size_t)n + 1);
    printf("{\"event\":\"stats\",\"pid\":%d,\"stats\":%s}\n", (int)getpid(), buf);
    free(buf);
}

#endif /* GPUSHARE_PROBE_EVENTS_H */
