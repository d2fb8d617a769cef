/*
 * libgpushare public status API.
 *
 * A process running under the shim (LD_PRELOAD=libgpushare.so) can ask the shim what it is doing.
 * The `%gpushare` magic reads this through cffi in ABI mode (no compiler needed), so this header
 * must stay plain C declarations that cffi's cdef() accepts: no macros in the declarations, no
 * includes that cffi would have to parse. jupyter_gpushare/shim.py repeats the declarations below;
 * tests/native/test_status_api.py checks that the two agree.
 */
#ifndef GPUSHARE_H
#define GPUSHARE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of struct gpushare_status; bumped when fields are added at the end. */
#define GPUSHARE_STATUS_VERSION 3

/* What the process is doing with the GPU. */
enum gpushare_state {
    GPUSHARE_STATE_INACTIVE = 0, /* no CUDA context yet: nothing to share */
    GPUSHARE_STATE_UNSHARED = 1, /* no scheduler reachable: running alone, retrying to connect */
    GPUSHARE_STATE_IDLE = 2,     /* connected, does not hold the device, not waiting */
    GPUSHARE_STATE_WAITING = 3,  /* a GPU call is blocked until the scheduler grants the device
                                    (of a process on several devices: any of them) */
    GPUSHARE_STATE_HOLDING = 4,  /* holds the device: GPU calls pass straight through */
    GPUSHARE_STATE_RELEASING = 5, /* handing the device back (synchronising, maybe evicting) */
    GPUSHARE_STATE_ASLEEP = 6     /* deep idle: memory and context checkpointed to the host */
};

struct gpushare_status {
    uint32_t version;        /* GPUSHARE_STATUS_VERSION of the library that filled it */
    uint32_t state;          /* enum gpushare_state */
    uint32_t connected;      /* 1 when a scheduler connection is up */
    uint32_t evicted;        /* 1 when managed memory is currently moved to the host */
    uint64_t used_bytes;     /* all device memory held, context estimate included */
    uint64_t managed_bytes;  /* the managed (evictable) part of used_bytes */
    uint64_t pinned_bytes;   /* the part that cannot be evicted */
    uint64_t evicted_bytes;  /* managed bytes now on the host */
    uint64_t quota_bytes;    /* effective quota; 0 = none */
    uint64_t pool_bytes;     /* the device pool as the scheduler sizes it; 0 = not known */
    uint64_t gated_calls;    /* GPU calls that went through the gate */
    uint64_t waits;          /* how many times a call had to wait for the device */
    double wait_seconds;     /* total time spent waiting for the device */
    double current_wait_seconds; /* how long the current wait has lasted; 0 when not waiting */
    double holding_seconds;  /* total time the device was held (GPU time as scheduled) */
    double idle_seconds;     /* time since the last gated call */
    char client_id[128];
    char socket_path[108];
    char device_uuid[48];
    /* Version 2: the memory engine's host side. */
    uint64_t precopied_bytes;        /* resident bytes whose host copy is current */
    uint64_t staging_pinned_bytes;   /* host staging registered with the driver */
    uint64_t staging_pageable_bytes; /* host staging past GPUSHARE_HOST_BUDGET (slower copies) */
    uint64_t staging_fallbacks;      /* staging buffers that fell back to pageable memory */
    /* Version 3: the restores this process reported to the scheduler (its RESTORED after a
     * grant) and the last one's figures. Memory made while waiting had no physical memory and is
     * only backed at the grant: none of it is counted as restored. */
    uint64_t restores;
    uint64_t last_restore_bytes;
    double last_restore_seconds;
};

/* Fill *out (of `size` bytes, normally sizeof(struct gpushare_status)). Returns 0, or -1 when
 * `out` is NULL or `size` is too small for the fields this library knows. Never blocks on the
 * scheduler: it copies the shim's own state under a short lock. Nor does it wait for a move of
 * memory in flight (an eviction or a restore holds the engine for seconds): `precopied_bytes`
 * is then the figure last read, or 0 after a GPU call since; the other fields are current. */
int gpushare_get_status(struct gpushare_status *out, size_t size);

/* Hand the device back now, as if the scheduler had revoked it: outstanding work is synchronised
 * first. Returns 0 when released (or not holding), -1 when there is no scheduler connection. */
int gpushare_release(void);

/* The library's version string, e.g. "0.1.0". */
const char *gpushare_version(void);

#ifdef __cplusplus
}
#endif

#endif /* GPUSHARE_H */
