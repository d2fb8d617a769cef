/*
 * A test-only interposer (tests/reliability/test_socket_race.py): every connect() to a Unix socket
 * waits GPUSHARE_TEST_CONNECT_DELAY_US first, as a process descheduled between its checks and
 * its connect on a loaded machine would. It widens the window a symlink race needs, so that a
 * check of a path that connect() looks up again loses it in a few tries, not one in a thousand.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

typedef int connect_fn(int, const struct sockaddr *, socklen_t);

int connect(int fd, const struct sockaddr *addr, socklen_t len)
{
    static connect_fn *real;
    if (!real)
        real = (connect_fn *)dlsym(RTLD_NEXT, "connect");
    const char *d = getenv("GPUSHARE_TEST_CONNECT_DELAY_US");
    if (addr && addr->sa_family == AF_UNIX && d && *d) {
        long us = strtol(d, NULL, 10);
        struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    return real(fd, addr, len);
}
