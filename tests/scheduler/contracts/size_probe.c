/* Reads one size per line on stdin and prints what the shim's parser (native/src/base/config.c) makes
 * of it: the byte count, or "-" when it refuses it. tests/scheduler/test_contracts.py compares
 * the answers with jupyter_gpushare/units.py on the same inputs. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int gs_parse_size(const char *text, uint64_t *out);

int main(void)
{
    static char line[1 << 16];
    while (fgets(line, sizeof line, stdin)) {
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n')
            line[--n] = 0;
        uint64_t value = 0;
        if (gs_parse_size(line, &value) == 0)
            printf("%llu\n", (unsigned long long)value);
        else
            printf("-\n");
    }
    return 0;
}
