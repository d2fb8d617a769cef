/*
 * The gpushare wire format (docs/protocol.md): 12-byte header (magic "GPSH", version 1, type,
 * reserved, little-endian payload length <= 65536), then TLV fields (u16 tag, u16 len, value).
 * Encoding writes into a caller-supplied buffer; decoding never reads past what it was given and
 * rejects every malformed frame the spec names.
 */
#ifndef GPUSHARE_PROTOCOL_H
#define GPUSHARE_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#define GS_PROTO_VERSION 1
#define GS_PROTO_HEADER 12
#define GS_PROTO_MAX_PAYLOAD 65536u

enum gs_msg_type {
    /* shim -> scheduler */
    GS_MSG_HELLO = 0x01,
    GS_MSG_REQUEST = 0x02,
    GS_MSG_RELEASED = 0x03,
    GS_MSG_MEMORY = 0x04,
    GS_MSG_IDLE = 0x05,
    GS_MSG_EVICTED = 0x06,
    GS_MSG_RESTORED = 0x07,
    GS_MSG_GOODBYE = 0x08,
    GS_MSG_PRECOPIED = 0x09,
    /* control */
    GS_MSG_STATUS_REQUEST = 0x20,
    GS_MSG_CONTROL = 0x21,
    /* scheduler -> shim */
    GS_MSG_WELCOME = 0x81,
    GS_MSG_GRANT = 0x82,
    GS_MSG_REVOKE = 0x83,
    GS_MSG_EVICT = 0x84,
    GS_MSG_SET_QUOTA = 0x85,
    GS_MSG_ERROR = 0x86,
    GS_MSG_PRECOPY = 0x87,
    /* Deep idle: flag 1 = the scheduler checkpointed this process (memory and context on the
     * host), 0 = it restored it; a GRANT follows a wake (docs/protocol.md, "Deep idle"). */
    GS_MSG_SLEEP = 0x88,
    /* Restore ahead: bring the evicted memory back while not holding the device (launches stay
     * gated); answered by RESTORED with flag 1 (docs/protocol.md, "Restore ahead"). */
    GS_MSG_RESTORE_AHEAD = 0x89,
    /* A holder's room changed (room_bytes; absent: no limit); a stale one (not holding) is
     * dropped, no answer (docs/protocol.md, "Room"). */
    GS_MSG_ROOM = 0x8A,
    /* Host memory is a budget: the most host staging this process may hold for its resident
     * memory (staging_bytes); never sent: the per-process bound alone (docs/protocol.md,
     * "Host memory"). No answer. */
    GS_MSG_STAGING = 0x8B,
    GS_MSG_STATUS = 0xA0,
    GS_MSG_CONTROL_REPLY = 0xA1
};

enum gs_tag {
    GS_TAG_CLIENT_ID = 1,
    GS_TAG_PID = 2,
    GS_TAG_DEVICE_UUID = 3,
    GS_TAG_DEVICE_NAME = 4,
    GS_TAG_DEVICE_TOTAL = 5,
    GS_TAG_QUOTA = 6,
    GS_TAG_WEIGHT_MILLI = 7,
    GS_TAG_USER = 8,
    GS_TAG_LABEL = 9,
    GS_TAG_USED_BYTES = 10,
    GS_TAG_MANAGED_BYTES = 11,
    GS_TAG_PINNED_BYTES = 12,
    GS_TAG_EVICTED_BYTES = 13,
    GS_TAG_FLAG = 14,
    GS_TAG_POOL_BYTES = 15,
    GS_TAG_QUANTUM_MS = 16,
    GS_TAG_REASON = 17,
    GS_TAG_BYTES_MOVED = 18,
    GS_TAG_MICROS = 19,
    GS_TAG_ERROR_CODE = 20,
    GS_TAG_MESSAGE = 21,
    GS_TAG_BODY = 22,
    GS_TAG_VERSION = 23,
    GS_TAG_IDLE_MS = 24,
    GS_TAG_CONTEXT_BYTES = 25,
    GS_TAG_TOKEN = 26,
    /* Reconnecting after the scheduler was lost (docs/protocol.md, "Scheduler restarts"). */
    GS_TAG_RESUME = 39,
    GS_TAG_SINCE_MS = 40,
    GS_TAG_GPU_MS = 41,
    /* GRANT: a secret (32 hex characters) the shim sends back in a HELLO with resume = 1, proving
     * that it is the process the old scheduler granted (docs/protocol.md). */
    GS_TAG_RESUME_SECRET = 42,
    /* The memory engine (docs/protocol.md, "Pre-copy"). */
    GS_TAG_PRECOPIED_BYTES = 43,
    /* REVOKE (with evict) and EVICT: the bytes to free on the device (0 or absent: everything). */
    GS_TAG_EVICT_BYTES = 44,
    /* GRANT: the most device memory the client may hold backed during this grant. */
    GS_TAG_ROOM_BYTES = 45,
    /* HELLO: GPUSHARE_KERNEL_SECRET, proving the kernel its id is bound to (docs/protocol.md). */
    GS_TAG_KERNEL_SECRET = 46,
    /* REQUEST: bytes the driver refused beyond the room it was granted (docs/protocol.md). */
    GS_TAG_SHORT_BYTES = 47,
    /* Host memory (docs/protocol.md, "Host memory"): MEMORY, REQUEST and a reconnecting HELLO
     * say all the host memory the engine holds (host_bytes) and the part that is staging of
     * resident memory (staging_bytes); STAGING carries the allowance in staging_bytes. */
    GS_TAG_HOST_BYTES = 49,
    GS_TAG_STAGING_BYTES = 50,
    GS_TAG_MAX = 50
};

/* ---- encoding ---- */

struct gs_writer {
    uint8_t *buf;
    size_t cap;
    size_t len;
    int overflow; /* a field did not fit: gs_w_finish() fails */
};

void gs_w_begin(struct gs_writer *w, uint8_t *buf, size_t cap, uint8_t type);
void gs_w_u64(struct gs_writer *w, uint16_t tag, uint64_t value);
/* A string field; truncated (at a UTF-8 boundary) to what a field and the buffer can hold. */
void gs_w_str(struct gs_writer *w, uint16_t tag, const char *s);
void gs_w_bytes(struct gs_writer *w, uint16_t tag, const void *p, size_t n);
/* Writes the payload length into the header. Returns the frame length, or 0 on overflow. */
size_t gs_w_finish(struct gs_writer *w);

/* ---- decoding ---- */

struct gs_msg {
    uint8_t type;
    uint64_t have;                    /* bit t set: tag t present (t <= GS_TAG_MAX) */
    uint64_t u64[GS_TAG_MAX + 1];     /* values of u64 tags */
    const uint8_t *str[GS_TAG_MAX + 1]; /* str/json tags: pointers into the frame, not terminated */
    uint16_t str_len[GS_TAG_MAX + 1];
};

enum { GS_PARSE_ERROR = -1, GS_PARSE_MORE = 0, GS_PARSE_OK = 1 };

/* Parse one frame from buf[0..len). GS_PARSE_OK: *msg filled, *frame_len bytes consumed (the
 * string pointers point into buf). GS_PARSE_MORE: incomplete, read more. GS_PARSE_ERROR: the
 * stream is corrupt (bad magic, version, length or field layout); drop the connection. */
int gs_parse(const uint8_t *buf, size_t len, struct gs_msg *msg, size_t *frame_len);

static inline int gs_msg_has(const struct gs_msg *m, int tag)
{
    return tag >= 0 && tag <= GS_TAG_MAX && (m->have >> tag) & 1u;
}
static inline uint64_t gs_msg_u64(const struct gs_msg *m, int tag, uint64_t dflt)
{
    return gs_msg_has(m, tag) ? m->u64[tag] : dflt;
}
/* Copy a str field into dst (terminated, truncated to cap-1). Returns 1 when present. */
int gs_msg_str(const struct gs_msg *m, int tag, char *dst, size_t cap);

#endif /* GPUSHARE_PROTOCOL_H */
