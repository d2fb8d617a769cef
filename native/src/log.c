/* Logging: one write(2) per line, so lines from several threads never interleave. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

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
