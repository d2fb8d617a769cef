/*
 * Which socket the shim talks to, and whether it may: the default path (jupyter_gpushare/paths.py
 * computes the same; tests/scheduler/test_contracts.py reads both) and the ownership rule that
 * keeps a HELLO (command line, user, user token) away from a socket another user put there
 * (issue 15's first two attacks).
 *
 * Kept apart from conn.c so that the rule a security review reads is one short file with no
 * connection state in it: what is checked is what is connected to (the directory's fd), and the
 * peer's credentials are checked before conn.c sends its HELLO (issue 22, items 1 and 2).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "session.h"

/* $GPUSHARE_SOCKET; root's system socket; else ${XDG_RUNTIME_DIR:-/tmp}/gpushare-$UID/. */
void gs_socket_default_path(char *out, size_t cap)
{
    const char *s = getenv("GPUSHARE_SOCKET");
    if (s && *s) {
        snprintf(out, cap, "%s", s);
        return;
    }
    uid_t uid = getuid();
    if (uid == 0) {
        snprintf(out, cap, "/run/gpushare/scheduler.sock");
        return;
    }
    const char *rt = getenv("XDG_RUNTIME_DIR");
    if (!rt || !*rt)
        rt = "/tmp";
    snprintf(out, cap, "%s/gpushare-%u/scheduler.sock", rt, (unsigned)uid);
}

/* The service account a node scheduler runs as, as the operator names it ($GPUSHARE_SERVICE_USER:
 * a user name or a uid); (uid_t)-1 when none is named. Never inferred from who owns a file: a
 * directory and socket that another user made are that user's, whoever it is (issue 22, item 2). */
static uid_t socket_service_uid(void)
{
    const char *name = getenv("GPUSHARE_SERVICE_USER");
    if (!name || !*name)
        return (uid_t)-1;
    char *end = NULL;
    errno = 0;
    unsigned long n = strtoul(name, &end, 10);
    if (errno == 0 && end && *end == 0 && n < (unsigned long)(uid_t)-1)
        return (uid_t)n;
    struct passwd pw, *found = NULL;
    char buf[1024];
    if (getpwnam_r(name, &pw, buf, sizeof buf, &found) != 0 || !found)
        return (uid_t)-1; /* an unknown name trusts nobody more */
    return found->pw_uid;
}

/* Whom this process may send a HELLO: itself, root, the named service account. */
static int socket_trusted_uid(uid_t uid, uid_t me, uid_t service)
{
    return uid == me || uid == 0 || (service != (uid_t)-1 && uid == service);
}

/* Split path into its directory and its last component (dir: sun_path's size). */
static int socket_split(const char *path, char *dir, size_t dircap, const char **base)
{
    if (strlen(path) >= dircap)
        return -1;
    snprintf(dir, dircap, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) {
        snprintf(dir, dircap, ".");
        *base = path;
    } else {
        *base = path + (slash - dir) + 1;
        if (slash == dir)
            dir[1] = 0;
        else
            *slash = 0;
    }
    return **base ? 0 : -1;
}

/* The rule of docs/protocol.md, "Trusting the socket" (jupyter_gpushare/paths.py says the same;
 * tests/native/test_socket_trust.py checks both), on the directory that is opened, not on a
 * path looked up twice (issue 22, item 1: a symlink flipped between a stat and the connect):
 * the directory, opened without following a link, is not writable by its group or by everyone
 * and belongs to this user, root or the named service account, and this user's own
 * gpushare-$UID directory (which anyone could make first in /tmp) to this user or root; the
 * socket in it is one and belongs to one of those. Returns the directory's O_PATH fd (1 in
 * *verdict), or -1 with *verdict 0 (refused) or -1 (missing) and `why` set. */
static int socket_open_dir(const char *dir, const char *base, uid_t me, uid_t service,
                           int *verdict, char *why, size_t whylen)
{
    *verdict = -1;
    int dfd = open(dir, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        int e = errno;
        if (e == ENOTDIR || e == ELOOP) {
            *verdict = 0;
            snprintf(why, whylen, "refusing the socket: its directory %s is a link or not a "
                     "directory", dir);
        } else {
            snprintf(why, whylen, "%s: %s", dir, strerror(e));
        }
        return -1;
    }
    struct stat st;
    const char *bad = NULL;
    char own_dir[32];
    snprintf(own_dir, sizeof own_dir, "gpushare-%u", (unsigned)me);
    const char *dbase = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
    if (fstat(dfd, &st) != 0) {
        snprintf(why, whylen, "%s: %s", dir, strerror(errno));
    } else if (!S_ISDIR(st.st_mode)) {
        bad = "";
        snprintf(why, whylen, "refusing the socket: %s is not a directory", dir);
    } else if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        bad = "";
        snprintf(why, whylen, "refusing the socket: its directory %s is writable by %s", dir,
                 st.st_mode & S_IWOTH ? "everyone" : "its group");
    } else if (st.st_uid != me && st.st_uid != 0 && strcmp(dbase, own_dir) == 0) {
        /* The reason first: a long path must not cut it off. */
        bad = "";
        snprintf(why, whylen,
                 "refusing the socket: another user (uid %u) made this user's socket directory %s",
                 (unsigned)st.st_uid, dir);
    } else if (!socket_trusted_uid(st.st_uid, me, service)) {
        bad = "";
        snprintf(why, whylen,
                 "refusing the socket: its directory %s belongs to uid %u (not this user, root or "
                 "GPUSHARE_SERVICE_USER)", dir, (unsigned)st.st_uid);
    } else if (fstatat(dfd, base, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        snprintf(why, whylen, "%s", strerror(errno));
    } else if (!S_ISSOCK(st.st_mode)) {
        bad = "";
        snprintf(why, whylen, "refusing %s/%s: not a socket", dir, base);
    } else if (!socket_trusted_uid(st.st_uid, me, service)) {
        bad = "";
        snprintf(why, whylen, "refusing %s/%s: it belongs to uid %u", dir, base,
                 (unsigned)st.st_uid);
    } else {
        *verdict = 1;
        return dfd;
    }
    if (bad)
        *verdict = 0;
    close(dfd);
    return -1;
}

/* connect() with the bounded wait of a handshake (fd non-blocking). 0, or an errno. */
static int socket_connect_bounded(int fd, const struct sockaddr_un *addr, int timeout_ms)
{
    if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0)
        return 0;
    int e = errno;
    if (e == EINPROGRESS || e == EAGAIN) {
        struct pollfd pfd = {fd, POLLOUT, 0};
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (poll(&pfd, 1, timeout_ms) == 1 &&
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr == 0)
            return 0;
        e = soerr ? soerr : ETIMEDOUT;
    }
    return e;
}

int gs_socket_connect(const char *path, int timeout_ms, int *refused, char *why, size_t whylen)
{
    *refused = 0;
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path) + 64];
    const char *base = NULL;
    if (socket_split(path, dir, sizeof dir, &base) != 0) {
        snprintf(why, whylen, "bad socket path");
        return -1;
    }
    uid_t me = getuid(), service = socket_service_uid();
    int verdict = -1;
    int dfd = socket_open_dir(dir, base, me, service, &verdict, why, whylen);
    if (dfd < 0) {
        *refused = verdict == 0;
        return -1;
    }
    /* Connect through the directory that was checked: /proc/self/fd/N/<name> walks from the
     * opened directory, so no link flipped since can send the connection elsewhere. It needs
     * no privilege, no chdir (the process's other threads keep their working directory), and
     * it also lifts sun_path's 108-byte limit on the directory part. Without /proc (a
     * stripped container) the path is used, and the peer check below still keeps the HELLO
     * from a scheduler of another user. */
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    char via[32];
    snprintf(via, sizeof via, "/proc/self/fd/%d", dfd);
    int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%s", via, base);
    struct stat st;
    if (n < 0 || (size_t)n >= sizeof addr.sun_path || stat(via, &st) != 0) {
        if (strlen(path) >= sizeof addr.sun_path) {
            close(dfd);
            snprintf(why, whylen, "path too long");
            return -1;
        }
        memcpy(addr.sun_path, path, strlen(path) + 1);
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        snprintf(why, whylen, "%s", strerror(errno));
        close(dfd);
        return -1;
    }
    int e = socket_connect_bounded(fd, &addr, timeout_ms);
    close(dfd);
    if (e != 0) {
        snprintf(why, whylen, "%s", strerror(e));
        close(fd);
        return -1;
    }
    /* Who listens, as the kernel says (the credentials of the listen()), before any byte. */
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
        !socket_trusted_uid(cred.uid, me, service)) {
        *refused = 1;
        snprintf(why, whylen, "refusing %s: the scheduler answering there runs as uid %u (not "
                 "this user, root or GPUSHARE_SERVICE_USER)", path, (unsigned)cred.uid);
        close(fd);
        return -1;
    }
    return fd;
}
