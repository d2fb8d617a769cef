/*
 * Prints what the shim's gs_parse_size (native/src/base/config.c, compiled in) makes of each argument:
 * one line per argument, the byte count or "invalid". tests/native/test_sizes.py compares it with
 * jupyter_gpushare/units.py, the Python side of the same size syntax.
 */
#include <stdio.h>

#include "base/shim.h"

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        uint64_t v = 0;
        if (gs_parse_size(argv[i], &v) == 0)
            printf("%llu\n", (unsigned long long)v);
        else
            printf("invalid\n");
    }
    return 0;
}
