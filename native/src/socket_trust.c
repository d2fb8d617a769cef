/*
 * Which socket the shim talks to, and whether it may: the default path (jupyter_gpushare/paths.py
 * computes the same; tests/scheduler/test_contracts.py reads both) and the ownership rule that
 * keeps a HELLO (command line, user, user token) away from a socket another user put there
 * (issue 15's first two attacks).
 *
 * Kept apart from conn.c so that the rule a security review reads is one short file with no
 * connection state in it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* The rule of docs/protocol.md, "Trusting the socket" (jupyter_gpushare/paths.py's
 * socket_distrust says the same; tests/native/test_socket_trust.py checks both): the directory is
 * not writable by its group or by everyone; it belongs to this user or root, or to one service
 * account (a node scheduler's, /run/gpushare) whose socket is that account's too, and never to
 * another user when it is this user's own gpushare-$UID directory, which anyone could have made
 * first in /tmp. The HELLO carries the command line, the user and the user token, and must never
 * go to a socket another user put there. */
int gs_socket_trusted(const char *path, char *why, size_t whylen)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == dir)
        dir[1] = 0;
    else
        *slash = 0;
    uid_t me = getuid();
    struct stat st;
    if (stat(dir, &st) != 0) {
        snprintf(why, whylen, "%s: %s", dir, strerror(errno));
        return -1;
    }
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(why, whylen, "refusing the socket: its directory %s is writable by %s", dir,
                 st.st_mode & S_IWOTH ? "everyone" : "its group");
        return 0;
    }
    uid_t dir_owner = st.st_uid;
    int dir_mine = dir_owner == me || dir_owner == 0;
    char own_dir[32];
    snprintf(own_dir, sizeof own_dir, "gpushare-%u", (unsigned)me);
    const char *base = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
    if (!dir_mine && strcmp(base, own_dir) == 0) {
        /* The reason first: a long path must not cut it off. */
        snprintf(why, whylen,
                 "refusing the socket: another user (uid %u) made this user's socket directory %s",
                 (unsigned)dir_owner, dir);
        return 0;
    }
    if (lstat(path, &st) != 0) {
        snprintf(why, whylen, "%s", strerror(errno));
        return -1;
    }
    if (!S_ISSOCK(st.st_mode)) {
        snprintf(why, whylen, "refusing %s: not a socket", path);
        return 0;
    }
    /* A directory of this user or root: the socket is this user's, root's or the directory
     * owner's. A service account's directory: the socket is that account's. */
    int sock_ok = dir_mine ? (st.st_uid == me || st.st_uid == 0 || st.st_uid == dir_owner)
                           : st.st_uid == dir_owner;
    if (!sock_ok) {
        snprintf(why, whylen, "refusing %s: it belongs to uid %u", path, (unsigned)st.st_uid);
        return 0;
    }
    return 1;
}
