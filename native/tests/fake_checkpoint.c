/*
 * The stand-in driver's process checkpoint API (cuCheckpointProcess*, CUDA 12.8+), included by
 * fake_libcuda.c, which owns the lock, the allocations and the mappings this file uses.
 *
 * The real API is called by another process (the scheduler) on a target pid; the driver does the
 * work inside the target. The stand-in does the same across two processes: with
 * GPUSHARE_FAKE_CHECKPOINT_DIR set, every process that ran cuInit serves a Unix socket
 * DIR/fakecuda-PID.sock from a thread of its own, and the exported cuCheckpointProcess* calls (in
 * the scheduler) send it one command byte and read back the result:
 *   L  lock: later CUDA calls of the target block (every entry point waits at COUNT()) and the
 *      device's work already queued finishes first;
 *   C  checkpoint (locked only): every device allocation and mapping is copied to host memory and
 *      overwritten with a poison byte, and the process holds 0 bytes of the device (its context's
 *      GPUSHARE_FAKE_CONTEXT_BYTES included) until it is restored; a process with managed memory
 *      is refused with CUDA_ERROR_NOT_SUPPORTED (801), as the real driver refuses it;
 *   R  restore (checkpointed only): the contents come back at the same addresses;
 *   U  unlock (locked only): the blocked calls go on;
 *   S  state (CUprocessState), M  device bytes the process holds now (what nvidia-smi would show).
 * A restore that did not happen shows as poisoned data (FK_POISON bytes); a grant sent before the
 * unlock shows as a call that blocks in the stand-in.
 *
 * Who may: as the driver, which checks the caller as ptrace would, a command from a process of
 * another uid (SO_PEERCRED of the caller) is refused with CUDA_ERROR_NOT_PERMITTED (800) unless
 * that caller is root. The socket itself is open to everyone (0666), so that the refusal is the
 * driver's answer, not a failed connect.
 */

enum { FK_PROC_RUNNING = 0, FK_PROC_LOCKED = 1, FK_PROC_CHECKPOINTED = 2 };
#define FK_POISON 0xA5

struct fk_saved {
    uintptr_t base;
    size_t size;
    unsigned char *copy;
};

static pthread_mutex_t g_ckpt_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_ckpt_cv = PTHREAD_COND_INITIALIZER;
static int g_ckpt_state; /* FK_PROC_*; read without the lock by the gate's fast path */
static struct fk_saved *g_saved;
static size_t g_nsaved, g_capsaved;

/* Every entry point's first step (COUNT()): wait while the process is locked. */
static void fk_ckpt_gate(void) {
    if (__atomic_load_n(&g_ckpt_state, __ATOMIC_ACQUIRE) == FK_PROC_RUNNING) return;
    pthread_mutex_lock(&g_ckpt_mu);
    while (g_ckpt_state != FK_PROC_RUNNING) pthread_cond_wait(&g_ckpt_cv, &g_ckpt_mu);
    pthread_mutex_unlock(&g_ckpt_mu);
}

static unsigned long long fk_context_bytes(void) {
    static unsigned long long v = (unsigned long long)-1;
    if (v == (unsigned long long)-1) v = fk_parse_bytes(getenv("GPUSHARE_FAKE_CONTEXT_BYTES"), 0);
    return v;
}

/* Device bytes the process holds now (the stand-in's per-process nvidia-smi figure). */
static unsigned long long fk_ckpt_usage(void) {
    if (__atomic_load_n(&g_ckpt_state, __ATOMIC_ACQUIRE) == FK_PROC_CHECKPOINTED) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long v = g_live_device_bytes + (g_live_managed_bytes - g_managed_on_host_bytes);
    pthread_mutex_unlock(&g_lock);
    return v + (g_inited ? fk_context_bytes() : 0);
}

static int fk_save_range(uintptr_t base, size_t size) {
    GROW(g_saved, g_nsaved, g_capsaved);
    unsigned char *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, (void *)base, size);
    memset((void *)base, FK_POISON, size);
    g_saved[g_nsaved++] = (struct fk_saved){base, size, copy};
    return 1;
}

/* Caller holds g_ckpt_mu. */
static long fk_ckpt_checkpoint_locked(void) {
    if (g_ckpt_state != FK_PROC_LOCKED) return 401; /* CUDA_ERROR_ILLEGAL_STATE */
    pthread_mutex_lock(&g_lock);
    if (g_live_managed_bytes > 0) {
        pthread_mutex_unlock(&g_lock);
        return 801;
    }
    int ok = 1;
    for (size_t i = 0; ok && i < g_nalloc; i++)
        if (g_allocs[i].kind != A_RESERVED && g_allocs[i].kind != A_MANAGED)
            ok = fk_save_range(g_allocs[i].base, g_allocs[i].size);
    for (size_t i = 0; ok && i < g_nmaps; i++) ok = fk_save_range(g_maps[i].base, g_maps[i].size);
    pthread_mutex_unlock(&g_lock);
    if (!ok) return 2; /* CUDA_ERROR_OUT_OF_MEMORY (of host memory) */
    fk_card_suspend(); /* its device memory is free for others until the restore */
    __atomic_store_n(&g_ckpt_state, FK_PROC_CHECKPOINTED, __ATOMIC_RELEASE);
    return 0;
}

/* Caller holds g_ckpt_mu. */
static long fk_ckpt_restore_locked(void) {
    if (g_ckpt_state != FK_PROC_CHECKPOINTED) return 401;
    if (fk_card_resume()) return 2; /* the card has no room for it now: still checkpointed */
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nsaved; i++) {
        memcpy((void *)g_saved[i].base, g_saved[i].copy, g_saved[i].size);
        free(g_saved[i].copy);
    }
    g_nsaved = 0;
    pthread_mutex_unlock(&g_lock);
    __atomic_store_n(&g_ckpt_state, FK_PROC_LOCKED, __ATOMIC_RELEASE);
    return 0;
}

static long fk_ckpt_command(char cmd, unsigned long long *value) {
    long rc = 0;
    *value = 0;
    if (cmd == 'M') {
        *value = fk_ckpt_usage();
        return 0;
    }
    pthread_mutex_lock(&g_ckpt_mu);
    switch (cmd) {
    case 'L':
        if (g_ckpt_state != FK_PROC_RUNNING) {
            rc = 401; /* CUDA_ERROR_ILLEGAL_STATE */
            break;
        }
        __atomic_store_n(&g_ckpt_state, FK_PROC_LOCKED, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&g_ckpt_mu);
        wait_device(); /* the work already queued finishes, as the real lock waits for it */
        pthread_mutex_lock(&g_ckpt_mu);
        break;
    case 'C':
        rc = fk_ckpt_checkpoint_locked();
        break;
    case 'R':
        rc = fk_ckpt_restore_locked();
        break;
    case 'U':
        if (g_ckpt_state != FK_PROC_LOCKED) {
            rc = 401;
            break;
        }
        __atomic_store_n(&g_ckpt_state, FK_PROC_RUNNING, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&g_ckpt_cv);
        break;
    case 'S':
        *value = (unsigned long long)g_ckpt_state;
        break;
    default:
        rc = 1;
    }
    pthread_mutex_unlock(&g_ckpt_mu);
    return rc;
}

static int fk_ckpt_path(int pid, char *out, size_t n) {
    const char *dir = getenv("GPUSHARE_FAKE_CHECKPOINT_DIR");
    if (!dir || !*dir) return 0;
    struct sockaddr_un a;
    int len = snprintf(out, n, "%s/fakecuda-%d.sock", dir, pid);
    return len > 0 && (size_t)len < n && (size_t)len < sizeof a.sun_path;
}

static void *fk_ckpt_serve(void *arg) {
    int fd = (int)(intptr_t)arg;
    for (;;) {
        int c = accept(fd, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        char cmd = 0;
        if (read(c, &cmd, 1) == 1) {
            unsigned long long reply[2] = {0, 0};
            struct ucred who;
            socklen_t wlen = sizeof who;
            long rc = CUDA_ERROR_NOT_PERMITTED;
            int known = getsockopt(c, SOL_SOCKET, SO_PEERCRED, &who, &wlen) == 0;
            if (cmd == 'M' || (known && (who.uid == 0 || who.uid == getuid())))
                rc = fk_ckpt_command(cmd, &reply[1]); /* M: the test's view of the card */
            reply[0] = (unsigned long long)rc;
            ssize_t w = write(c, reply, sizeof reply);
            (void)w;
        }
        close(c);
    }
}

/* From cuInit: serve this process's checkpoint commands (once). */
static void fk_ckpt_start(void) {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (!fk_ckpt_path((int)getpid(), path, sizeof path)) return;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    unlink(path);
    pthread_t t;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || chmod(path, 0666) != 0 ||
        listen(fd, 8) != 0 ||
        pthread_create(&t, NULL, fk_ckpt_serve, (void *)(intptr_t)fd) != 0) {
        close(fd);
        return;
    }
    pthread_detach(t);
}

/* The caller's side (the scheduler): one command to the target's stand-in. */
static CUresult fk_ckpt_ask(int pid, char cmd, unsigned long long *value) {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (pid <= 0 || !fk_ckpt_path(pid, path, sizeof path)) return CUDA_ERROR_INVALID_VALUE;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    unsigned long long reply[2] = {CUDA_ERROR_INVALID_VALUE, 0};
    size_t got = 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, &cmd, 1) == 1) {
        while (got < sizeof reply) {
            ssize_t r = read(fd, (char *)reply + got, sizeof reply - got);
            if (r <= 0) break;
            got += (size_t)r;
        }
    }
    close(fd);
    if (got != sizeof reply) return CUDA_ERROR_INVALID_VALUE; /* no such CUDA process */
    if (value) *value = reply[1];
    return (CUresult)reply[0];
}

CUresult cuCheckpointProcessLock(int pid, void *args) {
    (void)args; /* timeoutMs: the stand-in's lock waits only for queued work, which ends */
    return fk_ckpt_ask(pid, 'L', NULL);
}

CUresult cuCheckpointProcessCheckpoint(int pid, void *args) {
    (void)args;
    return fk_ckpt_ask(pid, 'C', NULL);
}

CUresult cuCheckpointProcessRestore(int pid, void *args) {
    (void)args;
    return fk_ckpt_ask(pid, 'R', NULL);
}

CUresult cuCheckpointProcessUnlock(int pid, void *args) {
    (void)args;
    return fk_ckpt_ask(pid, 'U', NULL);
}

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long v = 0;
    CUresult rc = fk_ckpt_ask(pid, 'S', &v);
    if (rc == CUDA_SUCCESS) *state = (int)v;
    return rc;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long v = 0;
    CUresult rc = fk_ckpt_ask(pid, 'S', &v);
    if (rc == CUDA_SUCCESS) *tid = pid;
    return rc;
}

/* Test-only: the device bytes process `pid` holds (its stand-in's answer), or -1. */
long long fakecuda_process_device_bytes(int pid) {
    unsigned long long v = 0;
    return fk_ckpt_ask(pid, 'M', &v) == CUDA_SUCCESS ? (long long)v : -1;
}
