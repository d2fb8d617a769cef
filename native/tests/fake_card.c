/*
 * One card shared by every process of a test (included by fake_libcuda.c in both builds, the
 * driver's and NVML's; not compiled alone).
 *
 * Without GPUSHARE_FAKE_CARD_FILE each process has a device of its own: it counts only its own
 * memory. With GPUSHARE_FAKE_CARD_FILE=PATH every stand-in of the test maps PATH (MAP_SHARED;
 * made on first use, mode 0666) and accounts there, as one card and one host:
 *   - per physical device, per process (a slot keyed by pid and the process's start time, field
 *     22 of /proc/PID/stat, so a reused pid is another process) the device bytes the process holds
 *     (cuMemAlloc*, cuMemCreate, stream-ordered and pool allocations, managed memory on the
 *     device, arrays, and GPUSHARE_FAKE_CONTEXT_BYTES for its first context on a device) and the
 *     host bytes it has pinned (cuMemHostRegister, cuMemHostAlloc);
 *   - an allocation that would take the device past its total (GPUSHARE_FAKE_DEVICE_TOTAL, with
 *     GPUSHARE_FAKE_OTHER_BYTES held beside) counting every live process's bytes is refused with
 *     CUDA_ERROR_OUT_OF_MEMORY; managed memory never passes the card either: what does not fit
 *     stays on the host (cuMemAllocManaged, prefetch, a kernel's fault) and is not refused;
 *   - a process that is gone (no /proc entry, a zombie, or a reused pid) has its bytes freed at
 *     the next look, as the driver frees a killed process's memory; one that exits frees its slot;
 *   - a process checkpointed (cuCheckpointProcessCheckpoint) holds nothing until its restore,
 *     which is refused with CUDA_ERROR_OUT_OF_MEMORY when its memory no longer fits;
 *   - cuMemGetInfo and NVML (nvmlDeviceGetMemoryInfo*, nvmlDeviceGetComputeRunningProcesses*)
 *     answer card-wide figures;
 *   - per device the most bytes the card ever held (peak) and the count of refusals; for the
 *     host the bytes pinned now, their peak and refusals (GPUSHARE_FAKE_HOST_LIMIT=BYTES: pinning
 *     past it, all processes together, is refused with CUDA_ERROR_OUT_OF_MEMORY; without a card
 *     file the limit applies to each process alone).
 * The layout (tests/native/card_file.py reads it; native-endian, all offsets fixed):
 *   0 magic "GSCARD01", 8 u32 version, ndev, nslots, slot_size, slots_at, unused,
 *   32 u64 host_limit, host_used, host_peak, host_refused,
 *   64 per device (8): u64 total, used, peak, refused,
 *   320 the robust process-shared mutex (128 bytes),
 *   448 slots (256): i32 pid (0: free), u32 unused, u64 start, host, host_peak, dev[8], dev_peak[8].
 * Each process checks against its own GPUSHARE_FAKE_DEVICE_TOTAL (the file keeps the first
 * process's totals for readers): the processes of one test should agree on it.
 */

#define FK_CARD_MAGIC "GSCARD01"
#define FK_CARD_VERSION 1u
#define FK_CARD_SLOTS 256

struct fk_card_dev {
    uint64_t total;   /* as the process that made the file saw it */
    uint64_t used;    /* every live process's bytes (the sum of the slots) */
    uint64_t peak;    /* the most `used` has been */
    uint64_t refused; /* allocations refused (or managed memory left on the host): card full */
};

struct fk_card_slot {
    int32_t pid; /* 0: free */
    uint32_t unused;
    uint64_t start; /* the process's start time (clock ticks after boot) */
    uint64_t host, host_peak;
    uint64_t dev[FK_MAX_DEV], dev_peak[FK_MAX_DEV];
};

struct fk_card {
    char magic[8];
    uint32_t version, ndev, nslots, slot_size, slots_at, unused;
    uint64_t host_limit, host_used, host_peak, host_refused;
    struct fk_card_dev dev[FK_MAX_DEV];
    union {
        pthread_mutex_t mu;
        char room[128];
    } lock;
    struct fk_card_slot slot[FK_CARD_SLOTS];
};

_Static_assert(offsetof(struct fk_card, host_limit) == 32, "card file layout");
_Static_assert(offsetof(struct fk_card, dev) == 64, "card file layout");
_Static_assert(offsetof(struct fk_card, lock) == 320, "card file layout");
_Static_assert(offsetof(struct fk_card, slot) == 448, "card file layout");
_Static_assert(sizeof(struct fk_card_slot) == 160, "card file layout");

static struct fk_card *g_card;

/* GPUSHARE_FAKE_OTHER_BYTES: memory processes outside the stand-in hold on the device. */
static unsigned long long fk_other_bytes(void) {
    return fk_parse_bytes(getenv("GPUSHARE_FAKE_OTHER_BYTES"), 0);
}

/* The start time of process `pid` (field 22 of /proc/PID/stat); 0 when it is gone or a zombie
 * (the driver frees a process's memory when it exits, not when it is reaped); UINT64_MAX when
 * it is there but cannot be read (taken as alive). */
static uint64_t fk_proc_start(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? 0 : UINT64_MAX;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    int err = errno;
    close(fd);
    if (n <= 0) return err == ESRCH || n == 0 ? 0 : UINT64_MAX;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command may hold spaces and parentheses */
    if (!p || !p[1] || !p[2]) return UINT64_MAX;
    p += 2; /* field 3: the state */
    if (*p == 'Z' || *p == 'X' || *p == 'x') return 0;
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    return p ? strtoull(p, NULL, 10) : UINT64_MAX;
}

static void fk_card_init(struct fk_card *c) {
    memset(c, 0, sizeof *c);
    c->version = FK_CARD_VERSION;
    c->ndev = FK_MAX_DEV;
    c->nslots = FK_CARD_SLOTS;
    c->slot_size = sizeof(struct fk_card_slot);
    c->slots_at = (uint32_t)offsetof(struct fk_card, slot);
    for (int d = 0; d < FK_MAX_DEV; d++) c->dev[d].total = d < fk_ndev() ? fk_phys_total(d) : 0;
    c->host_limit = fk_parse_bytes(getenv("GPUSHARE_FAKE_HOST_LIMIT"), 0);
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&c->lock.mu, &a);
    pthread_mutexattr_destroy(&a);
    memcpy(c->magic, FK_CARD_MAGIC, 8); /* last: a file without it is made again */
}

static void fk_card_open(void) {
    const char *path = getenv("GPUSHARE_FAKE_CARD_FILE");
    if (!path || !*path) return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        fprintf(stderr, "fakecuda: GPUSHARE_FAKE_CARD_FILE %s: %s; memory counted per process\n",
                path, strerror(errno));
        return;
    }
    struct fk_card *c = MAP_FAILED;
    struct stat st;
    /* flock: the first process makes the file while the others wait to map it. */
    if (flock(fd, LOCK_EX) == 0 && fstat(fd, &st) == 0 &&
        (st.st_size == (off_t)sizeof *c || (st.st_size == 0 && ftruncate(fd, sizeof *c) == 0)))
        c = mmap(NULL, sizeof *c, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (c != MAP_FAILED && memcmp(c->magic, FK_CARD_MAGIC, 8) != 0) {
        if (c->version == 0) {
            if (fchmod(fd, 0666) != 0) { /* another user's file: theirs to open up */
            }
            fk_card_init(c);
        } else {
            munmap(c, sizeof *c);
            c = MAP_FAILED;
        }
    }
    flock(fd, LOCK_UN);
    close(fd);
    if (c == MAP_FAILED) {
        fprintf(stderr, "fakecuda: GPUSHARE_FAKE_CARD_FILE %s is not a card file; memory counted "
                        "per process\n", path);
        return;
    }
    g_card = c;
}

/* The card file, or NULL when there is none. */
static struct fk_card *fk_card(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, fk_card_open);
    return g_card;
}

/* The figures from the slots (after a reap, or a process that died holding the lock). */
static void fk_card_recount_locked(struct fk_card *c) {
    uint64_t host = 0, dev[FK_MAX_DEV] = {0};
    for (int i = 0; i < FK_CARD_SLOTS; i++) {
        if (!c->slot[i].pid) continue;
        host += c->slot[i].host;
        for (int d = 0; d < FK_MAX_DEV; d++) dev[d] += c->slot[i].dev[d];
    }
    c->host_used = host;
    for (int d = 0; d < FK_MAX_DEV; d++) c->dev[d].used = dev[d];
}

static void fk_card_lock(struct fk_card *c) {
    if (pthread_mutex_lock(&c->lock.mu) == EOWNERDEAD) {
        pthread_mutex_consistent(&c->lock.mu);
        fk_card_recount_locked(c);
    }
}

static void fk_card_unlock(struct fk_card *c) { pthread_mutex_unlock(&c->lock.mu); }

/* Frees the memory of the processes that are gone, as the driver does. */
static void fk_card_reap_locked(struct fk_card *c) {
    for (int i = 0; i < FK_CARD_SLOTS; i++) {
        struct fk_card_slot *s = &c->slot[i];
        if (!s->pid) continue;
        uint64_t start = fk_proc_start(s->pid);
        if (start != UINT64_MAX && start != s->start) memset(s, 0, sizeof *s);
    }
    fk_card_recount_locked(c);
}

/* The bytes every live process holds on physical device `phys`. */
static unsigned long long fk_card_used(struct fk_card *c, int phys) {
    fk_card_lock(c);
    fk_card_reap_locked(c);
    unsigned long long used = c->dev[phys].used;
    fk_card_unlock(c);
    return used;
}

#ifndef GPUSHARE_FAKE_NVML

static void fk_note_high(uint64_t *high, uint64_t v) {
    if (v > *high) *high = v;
}

static int g_card_slot = -1, g_card_slot_pid;
static uint64_t g_card_suspended[FK_MAX_DEV]; /* a checkpointed process's bytes, per device */

/* This process's slot, claimed on first use (NULL when every slot is taken). */
static struct fk_card_slot *fk_card_own_locked(struct fk_card *c) {
    int pid = (int)getpid();
    if (g_card_slot >= 0 && g_card_slot_pid == pid && c->slot[g_card_slot].pid == pid)
        return &c->slot[g_card_slot];
    uint64_t start = fk_proc_start(pid);
    for (int pass = 0; pass < 2; pass++) {
        int found = -1, free_slot = -1;
        for (int i = 0; i < FK_CARD_SLOTS && found < 0; i++) {
            if (c->slot[i].pid == pid && c->slot[i].start == start) found = i;
            if (!c->slot[i].pid && free_slot < 0) free_slot = i;
        }
        if (found < 0 && free_slot >= 0) {
            found = free_slot;
            memset(&c->slot[found], 0, sizeof c->slot[found]);
            c->slot[found].pid = pid;
            c->slot[found].start = start;
        }
        if (found >= 0) {
            g_card_slot = found;
            g_card_slot_pid = pid;
            return &c->slot[found];
        }
        fk_card_reap_locked(c);
    }
    static int warned;
    if (!warned++) fprintf(stderr, "fakecuda: the card file has no free slot; not counted\n");
    return NULL;
}

/* Physical device `phys` takes `n` more bytes of this process's; CUDA_ERROR_OUT_OF_MEMORY when
 * every live process's bytes, `other` and `n` together would pass `total`. */
static CUresult fk_card_take(int phys, uint64_t n, uint64_t total, uint64_t other) {
    struct fk_card *c = fk_card();
    fk_card_lock(c);
    struct fk_card_dev *d = &c->dev[phys];
    if (d->used + other + n > total || d->used + n > d->peak) fk_card_reap_locked(c);
    struct fk_card_slot *s = fk_card_own_locked(c);
    if (d->used + other + n > total) {
        d->refused++;
        fk_card_unlock(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (s) {
        s->dev[phys] += n;
        fk_note_high(&s->dev_peak[phys], s->dev[phys]);
        d->used += n;
        fk_note_high(&d->peak, d->used);
    }
    fk_card_unlock(c);
    return CUDA_SUCCESS;
}

static void fk_card_give(int phys, uint64_t n) {
    struct fk_card *c = fk_card();
    fk_card_lock(c);
    struct fk_card_slot *s = fk_card_own_locked(c);
    if (s) {
        uint64_t m = n < s->dev[phys] ? n : s->dev[phys];
        s->dev[phys] -= m;
        c->dev[phys].used -= m < c->dev[phys].used ? m : c->dev[phys].used;
    }
    fk_card_unlock(c);
}

/* Pins `n` more host bytes of this process's; refused past `limit` (0: none), all processes
 * together. */
static CUresult fk_card_host_take(uint64_t n, uint64_t limit) {
    struct fk_card *c = fk_card();
    fk_card_lock(c);
    if ((limit && c->host_used + n > limit) || c->host_used + n > c->host_peak)
        fk_card_reap_locked(c);
    struct fk_card_slot *s = fk_card_own_locked(c);
    if (limit && c->host_used + n > limit) {
        c->host_refused++;
        fk_card_unlock(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (s) {
        s->host += n;
        fk_note_high(&s->host_peak, s->host);
        c->host_used += n;
        fk_note_high(&c->host_peak, c->host_used);
    }
    fk_card_unlock(c);
    return CUDA_SUCCESS;
}

static void fk_card_host_give(uint64_t n) {
    struct fk_card *c = fk_card();
    fk_card_lock(c);
    struct fk_card_slot *s = fk_card_own_locked(c);
    if (s) {
        uint64_t m = n < s->host ? n : s->host;
        s->host -= m;
        c->host_used -= m < c->host_used ? m : c->host_used;
    }
    fk_card_unlock(c);
}

/* A checkpoint frees the process's device memory on the card; its restore takes it again. */
static void fk_card_suspend(void) {
    struct fk_card *c = fk_card();
    if (!c) return;
    fk_card_lock(c);
    struct fk_card_slot *s = fk_card_own_locked(c);
    for (int d = 0; s && d < FK_MAX_DEV; d++) {
        g_card_suspended[d] = s->dev[d];
        s->dev[d] = 0;
    }
    fk_card_recount_locked(c);
    fk_card_unlock(c);
}

static CUresult fk_card_resume(void) {
    struct fk_card *c = fk_card();
    if (!c) return CUDA_SUCCESS;
    fk_card_lock(c);
    fk_card_reap_locked(c);
    uint64_t other = fk_other_bytes();
    for (int d = 0; d < fk_ndev(); d++) {
        if (c->dev[d].used + other + g_card_suspended[d] > fk_phys_total(d)) {
            c->dev[d].refused++;
            fk_card_unlock(c);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    struct fk_card_slot *s = fk_card_own_locked(c);
    for (int d = 0; s && d < FK_MAX_DEV; d++) {
        s->dev[d] += g_card_suspended[d];
        g_card_suspended[d] = 0;
        fk_note_high(&s->dev_peak[d], s->dev[d]);
    }
    fk_card_recount_locked(c);
    for (int d = 0; d < FK_MAX_DEV; d++) fk_note_high(&c->dev[d].peak, c->dev[d].used);
    fk_card_unlock(c);
    return CUDA_SUCCESS;
}

/* A process that exits frees its memory and its slot (one killed is reaped by the next look). */
__attribute__((destructor)) static void fk_card_leave(void) {
    struct fk_card *c = g_card;
    if (!c || g_card_slot < 0 || g_card_slot_pid != (int)getpid()) return;
    fk_card_lock(c);
    if (c->slot[g_card_slot].pid == g_card_slot_pid) memset(&c->slot[g_card_slot], 0,
                                                            sizeof c->slot[g_card_slot]);
    fk_card_recount_locked(c);
    fk_card_unlock(c);
}

/* GPUSHARE_FAKE_HOST_LIMIT: the bytes the host lets be pinned (0: no limit). */
static unsigned long long fk_host_limit(void) {
    return fk_parse_bytes(getenv("GPUSHARE_FAKE_HOST_LIMIT"), 0);
}

#endif /* !GPUSHARE_FAKE_NVML */
