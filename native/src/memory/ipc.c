/*
 * CUDA IPC of explicit memory (torch.multiprocessing, CuPy): the legacy cuIpcGetMemHandle /
 * cuIpcOpenMemHandle / cuIpcCloseMemHandle, rebuilt on the VMM API the engine already uses.
 *
 * The driver's legacy handle only names cuMemAlloc memory; the engine's memory is cuMemCreate
 * physical memory mapped at a reserved range. So the shim fabricates the 64-byte handle itself
 * (magic, exporter pid, the block's id, the offset in it, a random key per block) and each
 * exporting process serves its blocks' physical memory on an abstract Unix socket named after its
 * uid and pid: an importer of the same uid (SO_PEERCRED, checked both ways) sends the id and key
 * and receives a POSIX file descriptor (cuMemExportToShareableHandle), which it imports
 * (cuMemImportFromShareableHandle), maps at a range of its own and returns.
 *
 * The importer keeps its connection open until cuIpcCloseMemHandle (or its exit): the exporter
 * counts live importers by their connections, so a crashed importer is noticed. A block is pinned
 * from its export until its last importer is gone: eviction and pre-copy skip it (it would pull
 * the physical pages from under the peer) and it is reported as pinned, not evictable.
 * Handles that are not ours (plain cuMemAlloc memory under GPUSHARE_MEMORY=device) pass through.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "vmm.h"

enum { POSIX_FD_HANDLE = 1 }; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
enum { ST_OK = 0, ST_UNKNOWN = 1, ST_EVICTED = 2, ST_EXPORT_FAILED = 3 };
#define MAGIC "GSIPCv1"
#define MAX_CONNS 1024

struct ipc_handle {
    char magic[8];
    uint32_t pid, uid;
    uint64_t id, offset, size;
    uint8_t key[16];
    uint8_t unused[8];
};
_Static_assert(sizeof(struct ipc_handle) == sizeof(CUipcMemHandle), "the handle is 64 bytes");

struct ipc_request {
    uint64_t id;
    uint8_t key[16];
};
struct ipc_reply {
    int32_t status;
    uint32_t unused;
    uint64_t size;
};

typedef CUresult (*export_fn)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
typedef CUresult (*import_fn)(CUmemGenericAllocationHandle *, void *, int);

static int socket_name(struct sockaddr_un *a, uint32_t uid, uint32_t pid)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    /* Abstract: nothing on disk to clean up after a crash; the peer's uid is checked instead. */
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "gpushare-ipc-%u-%u", uid, pid);
    return (int)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static int peer_uid_ok(int fd, pid_t want_pid)
{
    struct ucred cr;
    socklen_t len = sizeof cr;
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && cr.uid == geteuid() &&
           (!want_pid || cr.pid == want_pid);
}

/* ---- the exporter's server ---- */

static pthread_mutex_t server_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t server_pid; /* the process whose server runs: a forked child starts its own */
static int listen_fd = -1;

static struct block *block_by_id(uint64_t id)
{
    for (size_t i = 0; i < gs_vmm_nblocks; i++)
        if (gs_vmm_blocks[i]->id == id)
            return gs_vmm_blocks[i];
    return NULL;
}

/* Answer one request on fd; returns the block id now imported through it (counted), or 0. */
static uint64_t serve_request(int fd)
{
    struct ipc_request rq;
    if (recv(fd, &rq, sizeof rq, MSG_WAITALL) != (ssize_t)sizeof rq)
        return 0;
    static export_fn export_handle;
    if (!export_handle)
        export_handle = (export_fn)gs_driver_sym("cuMemExportToShareableHandle");
    struct ipc_reply rp = {.status = ST_UNKNOWN};
    int share = -1;
    pthread_mutex_lock(&gs_vmm_mu);
    struct block *b = block_by_id(rq.id);
    if (b && b->ipc_pinned && !memcmp(b->ipc_key, rq.key, sizeof rq.key)) {
        if (!b->resident)
            rp.status = ST_EVICTED;
        else if (!export_handle || export_handle(&share, b->handle, POSIX_FD_HANDLE, 0) != CUDA_SUCCESS)
            rp.status = ST_EXPORT_FAILED;
        else {
            rp.status = ST_OK;
            rp.size = b->size;
            b->ipc_importers++;
        }
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    char ctl[CMSG_SPACE(sizeof(int))] = {0};
    struct iovec iov = {&rp, sizeof rp};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (share >= 0) {
        m.msg_control = ctl;
        m.msg_controllen = sizeof ctl;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &share, sizeof share);
    }
    /* A failed send breaks the connection: its end is then seen as the importer leaving. */
    (void)sendmsg(fd, &m, MSG_NOSIGNAL);
    if (share >= 0)
        close(share);
    return rp.status == ST_OK ? rq.id : 0;
}

/* An importer's connection closed (cuIpcCloseMemHandle, or its exit): one fewer on the block;
 * the last one unpins it. */
static void importer_gone(uint64_t id)
{
    pthread_mutex_lock(&gs_vmm_mu);
    struct block *b = block_by_id(id);
    if (b && b->ipc_importers && --b->ipc_importers == 0)
        b->ipc_pinned = 0;
    pthread_mutex_unlock(&gs_vmm_mu);
    gs_client_wake(); /* the totals changed: pinned bytes became evictable */
}

static void *server(void *arg)
{
    int lfd = (int)(intptr_t)arg;
    struct pollfd *fds = calloc(MAX_CONNS + 1, sizeof *fds);
    uint64_t *ids = calloc(MAX_CONNS + 1, sizeof *ids);
    if (!fds || !ids)
        return NULL;
    nfds_t n = 1;
    fds[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
    for (;;) {
        if (poll(fds, n, -1) < 0)
            continue;
        for (nfds_t i = n; i-- > 1;) {
            if (!fds[i].revents)
                continue;
            if (!ids[i]) {
                ids[i] = serve_request(fds[i].fd);
                if (ids[i])
                    continue; /* imported: the connection now lives as long as the import */
            } else {
                char c;
                if (recv(fds[i].fd, &c, 1, MSG_DONTWAIT) > 0)
                    continue; /* importers send nothing more; ignore it */
                importer_gone(ids[i]);
            }
            close(fds[i].fd);
            fds[i] = fds[--n];
            ids[i] = ids[n];
        }
        if (fds[0].revents & POLLIN) {
            int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (c >= 0 && (n > MAX_CONNS || !peer_uid_ok(c, 0))) {
                close(c); /* another user, or too many: never served */
            } else if (c >= 0) {
                fds[n] = (struct pollfd){.fd = c, .events = POLLIN};
                ids[n++] = 0;
            }
        }
    }
    return NULL;
}

/* Start this process's server once (again in a forked child). 0 when it runs. */
static int server_start(void)
{
    pthread_mutex_lock(&server_mu);
    int ok = server_pid == getpid();
    if (!ok) {
        if (listen_fd >= 0)
            close(listen_fd); /* the parent's, inherited */
        struct sockaddr_un a;
        int len = socket_name(&a, (uint32_t)geteuid(), (uint32_t)getpid());
        listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* the app's signals stay on its threads */
        ok = listen_fd >= 0 && bind(listen_fd, (struct sockaddr *)&a, (socklen_t)len) == 0 &&
             listen(listen_fd, 64) == 0 &&
             pthread_create(&t, &attr, server, (void *)(intptr_t)listen_fd) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (ok)
            server_pid = getpid();
        else
            GS_WARN("cuIpcGetMemHandle: cannot serve CUDA IPC (socket: %s)", strerror(errno));
    }
    pthread_mutex_unlock(&server_mu);
    return ok ? 0 : -1;
}

CUresult gs_mem_ipc_get_handle(gs_fn_cuIpcGetMemHandle real, CUipcMemHandle *pHandle,
                               CUdeviceptr dptr)
{
    if (gs_config()->disabled || !pHandle || !gs_vmm_driver_ready())
        return real(pHandle, dptr);
    /* The handle names the allocation containing dptr, as the driver's does: an importer gets
     * the allocation's base, not dptr. */
    CUdeviceptr base;
    size_t bytes;
    if (!gs_vmm_range(dptr, &base, &bytes))
        return real(pHandle, dptr);
    struct ipc_handle h = {.magic = MAGIC, .pid = (uint32_t)getpid(), .uid = (uint32_t)geteuid()};
    pthread_mutex_lock(&gs_vmm_mu);
    struct block *b = gs_vmm_find(base);
    int exportable = b && gs_vmm_exportable;
    if (exportable) {
        static const uint8_t none[16];
        if (!memcmp(b->ipc_key, none, sizeof none) &&
            getrandom(b->ipc_key, sizeof b->ipc_key, 0) != (ssize_t)sizeof b->ipc_key)
            exportable = 0;
        b->ipc_pinned = exportable; /* from now until its last importer is gone */
        h.id = b->id;
        h.offset = base - b->va;
        h.size = b->size;
        memcpy(h.key, b->ipc_key, sizeof h.key);
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    if (!b)
        return real(pHandle, dptr); /* not the engine's: the driver's own handle */
    if (!exportable || server_start() != 0) {
        GS_WARN("cuIpcGetMemHandle: the driver cannot export this process's CUDA memory "
                "(cuMemCreate refused POSIX file descriptor handles); start the processes that "
                "share CUDA memory with GPUSHARE_MEMORY=device");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    gs_client_wake(); /* pinned bytes changed */
    memcpy(pHandle, &h, sizeof h);
    return CUDA_SUCCESS;
}

/* ---- the importer ---- */

struct import {
    CUdeviceptr va;
    uint64_t size;
    int conn; /* open while imported: the exporter counts importers by their connections */
};
static pthread_mutex_t imports_mu = PTHREAD_MUTEX_INITIALIZER;
static struct import *imports;
static size_t nimports, capimports;

/* Ask the exporter for the block's memory: a file descriptor (or -1 and a status) and the
 * connection to keep. */
static int fetch(const struct ipc_handle *h, int *conn, int *status, uint64_t *size)
{
    struct sockaddr_un a;
    int len = socket_name(&a, h->uid, h->pid);
    *conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (*conn < 0 || connect(*conn, (struct sockaddr *)&a, (socklen_t)len) != 0 ||
        !peer_uid_ok(*conn, (pid_t)h->pid))
        return -1;
    struct ipc_request rq = {.id = h->id};
    memcpy(rq.key, h->key, sizeof rq.key);
    if (send(*conn, &rq, sizeof rq, MSG_NOSIGNAL) != (ssize_t)sizeof rq)
        return -1;
    struct ipc_reply rp;
    char ctl[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&rp, sizeof rp};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = sizeof ctl};
    if (recvmsg(*conn, &m, MSG_WAITALL | MSG_CMSG_CLOEXEC) != (ssize_t)sizeof rp)
        return -1;
    *status = rp.status;
    *size = rp.size;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    int fd = -1;
    if (c && c->cmsg_type == SCM_RIGHTS)
        memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* Import fd's physical memory and map it at a new range in the current context. */
static CUresult map_import(int fd, uint64_t size, CUdeviceptr *va)
{
    static import_fn import_handle;
    if (!import_handle)
        import_handle = (import_fn)gs_driver_sym("cuMemImportFromShareableHandle");
    CUmemGenericAllocationHandle ph;
    CUresult r = import_handle ? import_handle(&ph, (void *)(intptr_t)fd, POSIX_FD_HANDLE)
                               : CUDA_ERROR_NOT_SUPPORTED;
    if (r != CUDA_SUCCESS)
        return r;
    CUdevice dev = 0;
    gs_vmm_drv.ctx_dev(&dev);
    r = gs_vmm_drv.reserve(va, size, 0, 0, 0);
    if (r == CUDA_SUCCESS) {
        r = gs_vmm_drv.map(*va, size, 0, ph, 0);
        gs_mem_access_desc d = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, GS_MEM_ACCESS_FLAGS_PROT_READWRITE};
        if (r == CUDA_SUCCESS && (r = gs_vmm_drv.access(*va, size, &d, 1)) != CUDA_SUCCESS)
            gs_vmm_drv.unmap(*va, size);
        if (r != CUDA_SUCCESS)
            gs_vmm_drv.addr_free(*va, size);
    }
    GS_REAL(cuMemRelease)(ph); /* the mapping holds the memory from here on */
    return r;
}

static const char *refusal(int status)
{
    switch (status) {
    case ST_EVICTED:
        return "the exporting process's memory is on the host now (its last importer had closed "
               "it, which unpins it); call cuIpcGetMemHandle again in the exporting process";
    case ST_EXPORT_FAILED:
        return "the driver refused to export the memory";
    case ST_UNKNOWN:
        return "the exporting process has freed that memory";
    default:
        return "the exporting process cannot be reached (it exited, or runs as another user)";
    }
}

CUresult gs_mem_ipc_open(gs_fn_cuIpcOpenMemHandle_v2 real, CUdeviceptr *pdptr,
                         CUipcMemHandle handle, unsigned int flags)
{
    struct ipc_handle h;
    memcpy(&h, &handle, sizeof h);
    if (gs_config()->disabled || !pdptr || memcmp(h.magic, MAGIC, sizeof h.magic) != 0)
        return real(pdptr, handle, flags);
    if (!gs_vmm_driver_ready() || h.offset >= h.size)
        return CUDA_ERROR_INVALID_VALUE;
    int conn = -1, status = -1;
    uint64_t size = 0;
    int fd = fetch(&h, &conn, &status, &size);
    CUdeviceptr va = 0;
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    if (fd >= 0 && status == ST_OK && size == h.size) {
        r = map_import(fd, size, &va);
        if (r != CUDA_SUCCESS)
            GS_WARN("cuIpcOpenMemHandle: importing the exported memory failed (CUDA error %d)",
                    (int)r);
    } else {
        GS_WARN("cuIpcOpenMemHandle: %s; processes that must share CUDA memory regardless can "
                "run with GPUSHARE_MEMORY=device",
                refusal(status));
        r = status == ST_UNKNOWN ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED;
    }
    if (fd >= 0)
        close(fd);
    pthread_mutex_lock(&imports_mu);
    if (r == CUDA_SUCCESS && nimports == capimports) {
        size_t cap = capimports ? capimports * 2 : 16;
        struct import *n = realloc(imports, cap * sizeof *n);
        if (n) {
            imports = n;
            capimports = cap;
        } else {
            gs_vmm_drv.unmap(va, size);
            gs_vmm_drv.addr_free(va, size);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (r == CUDA_SUCCESS) {
        imports[nimports++] = (struct import){va, size, conn};
        *pdptr = va + h.offset;
    } else if (conn >= 0) {
        close(conn);
    }
    pthread_mutex_unlock(&imports_mu);
    return r;
}

CUresult gs_mem_ipc_close(gs_fn_cuIpcCloseMemHandle real, CUdeviceptr dptr)
{
    if (gs_config()->disabled)
        return real(dptr);
    pthread_mutex_lock(&imports_mu);
    size_t i = 0;
    while (i < nimports && !(dptr >= imports[i].va && dptr - imports[i].va < imports[i].size))
        i++;
    struct import im = i < nimports ? imports[i] : (struct import){0};
    if (i < nimports)
        imports[i] = imports[--nimports];
    pthread_mutex_unlock(&imports_mu);
    if (!im.va)
        return real(dptr);
    /* Like the driver's close: work using the mapping finishes first. */
    gs_vmm_drv.ctx_sync();
    gs_vmm_drv.unmap(im.va, im.size);
    gs_vmm_drv.addr_free(im.va, im.size);
    close(im.conn); /* the exporter sees it: one importer fewer */
    return CUDA_SUCCESS;
}
