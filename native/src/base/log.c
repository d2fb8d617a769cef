/* Logging: one write(2) per line, so lines from several threads never interleave. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "shim.h"

/* The level is read here, not in config.c, so that logging sits below the configuration (which
 * logs its own warnings) and never calls back up into it. */
static int log_level = GS_LOG_WARN;
static pthread_once_t level_once = PTHREAD_ONCE_INIT;

static void read_level(void)
{
    const char *v = getenv("GPUSHARE_LOG");
    if (!v || !*v)
        return;
    if (!strcasecmp(v, "quiet") || !strcasecmp(v, "off") || !strcasecmp(v, "none"))
        log_level = GS_LOG_QUIET;
    else if (!strcasecmp(v, "warn") || !strcasecmp(v, "warning"))
        log_level = GS_LOG_WARN;
    else if (!strcasecmp(v, "info"))
        log_level = GS_LOG_INFO;
    else if (!strcasecmp(v, "debug"))
        log_level = GS_LOG_DEBUG;
}

int gs_log_level_now(void)
{
    pthread_once(&level_once, read_level);
    return log_level;
}

void gs_log(int level, const char *fmt, ...)
{
    if (gs_log_level_now() < level)
        return;
    char line[1024];
    int n = snprintf(line, sizeof line, "gpushare: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
