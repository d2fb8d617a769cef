/* Frame encoding and decoding; see protocol.h and docs/protocol.md. */
#include <string.h>

#include "protocol.h"

enum { T_UNKNOWN = 0, T_U64, T_STR };

/* The value type of each known tag (json is a string as far as framing goes). */
static const uint8_t tag_type[GS_TAG_MAX + 1] = {
    [GS_TAG_CLIENT_ID] = T_STR,      [GS_TAG_PID] = T_U64,
    [GS_TAG_DEVICE_UUID] = T_STR,    [GS_TAG_DEVICE_NAME] = T_STR,
    [GS_TAG_DEVICE_TOTAL] = T_U64,   [GS_TAG_QUOTA] = T_U64,
    [GS_TAG_WEIGHT_MILLI] = T_U64,   [GS_TAG_USER] = T_STR,
    [GS_TAG_LABEL] = T_STR,          [GS_TAG_USED_BYTES] = T_U64,
    [GS_TAG_MANAGED_BYTES] = T_U64,  [GS_TAG_PINNED_BYTES] = T_U64,
    [GS_TAG_EVICTED_BYTES] = T_U64,  [GS_TAG_FLAG] = T_U64,
    [GS_TAG_POOL_BYTES] = T_U64,     [GS_TAG_QUANTUM_MS] = T_U64,
    [GS_TAG_REASON] = T_STR,         [GS_TAG_BYTES_MOVED] = T_U64,
    [GS_TAG_MICROS] = T_U64,         [GS_TAG_ERROR_CODE] = T_U64,
    [GS_TAG_MESSAGE] = T_STR,        [GS_TAG_BODY] = T_STR,
    [GS_TAG_VERSION] = T_STR,        [GS_TAG_IDLE_MS] = T_U64,
    [GS_TAG_CONTEXT_BYTES] = T_U64,  [GS_TAG_TOKEN] = T_STR,
    [GS_TAG_RESUME] = T_U64,         [GS_TAG_SINCE_MS] = T_U64,
    [GS_TAG_GPU_MS] = T_U64,         [GS_TAG_RESUME_SECRET] = T_STR,
    [GS_TAG_PRECOPIED_BYTES] = T_U64, [GS_TAG_EVICT_BYTES] = T_U64,
    [GS_TAG_ROOM_BYTES] = T_U64,     [GS_TAG_KERNEL_SECRET] = T_STR,
    [GS_TAG_SHORT_BYTES] = T_U64,
    [GS_TAG_HOST_BYTES] = T_U64,     [GS_TAG_STAGING_BYTES] = T_U64,
};

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

void gs_w_begin(struct gs_writer *w, uint8_t *buf, size_t cap, uint8_t type)
{
    w->buf = buf;
    w->cap = cap;
    w->len = 0;
    w->overflow = cap < GS_PROTO_HEADER;
    if (w->overflow)
        return;
    memcpy(buf, "GPSH", 4);
    buf[4] = GS_PROTO_VERSION;
    buf[5] = type;
    buf[6] = buf[7] = 0;
    put_le(buf + 8, 0, 4);
    w->len = GS_PROTO_HEADER;
}

static uint8_t *field(struct gs_writer *w, uint16_t tag, size_t n)
{
    if (w->overflow || n > 0xFFFF || w->len + 4 + n > w->cap ||
        w->len - GS_PROTO_HEADER + 4 + n > GS_PROTO_MAX_PAYLOAD) {
        w->overflow = 1;
        return NULL;
    }
    uint8_t *p = w->buf + w->len;
    put_le(p, tag, 2);
    put_le(p + 2, n, 2);
    w->len += 4 + n;
    return p + 4;
}

void gs_w_u64(struct gs_writer *w, uint16_t tag, uint64_t value)
{
    uint8_t *p = field(w, tag, 8);
    if (p)
        put_le(p, value, 8);
}

void gs_w_bytes(struct gs_writer *w, uint16_t tag, const void *data, size_t n)
{
    uint8_t *p = field(w, tag, n);
    if (p && n)
        memcpy(p, data, n);
}

void gs_w_str(struct gs_writer *w, uint16_t tag, const char *s)
{
    if (!s)
        s = "";
    size_t n = strlen(s);
    /* Room left for the value: the buffer, the field's u16 length and the payload limit. */
    size_t room = 0;
    if (!w->overflow && w->len + 4 <= w->cap) {
        room = w->cap - w->len - 4;
        size_t payload_room = GS_PROTO_MAX_PAYLOAD - (w->len - GS_PROTO_HEADER);
        payload_room = payload_room >= 4 ? payload_room - 4 : 0;
        if (room > payload_room)
            room = payload_room;
        if (room > 0xFFFF)
            room = 0xFFFF;
    }
    if (n > room) {
        n = room;
        /* Do not cut a UTF-8 sequence in half: back up over continuation bytes. */
        while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
            n--;
    }
    gs_w_bytes(w, tag, s, n);
}

size_t gs_w_finish(struct gs_writer *w)
{
    if (w->overflow)
        return 0;
    put_le(w->buf + 8, w->len - GS_PROTO_HEADER, 4);
    return w->len;
}

int gs_parse(const uint8_t *buf, size_t len, struct gs_msg *msg, size_t *frame_len)
{
    /* Check the magic as soon as its bytes arrive, so garbage is refused without waiting. */
    size_t magic_have = len < 4 ? len : 4;
    if (memcmp(buf, "GPSH", magic_have) != 0)
        return GS_PARSE_ERROR;
    if (len >= 5 && buf[4] != GS_PROTO_VERSION)
        return GS_PARSE_ERROR;
    if (len < GS_PROTO_HEADER)
        return GS_PARSE_MORE;
    uint64_t payload = get_le(buf + 8, 4);
    if (payload > GS_PROTO_MAX_PAYLOAD)
        return GS_PARSE_ERROR;
    if (len < GS_PROTO_HEADER + payload)
        return GS_PARSE_MORE;

    memset(msg, 0, sizeof *msg);
    msg->type = buf[5];
    const uint8_t *p = buf + GS_PROTO_HEADER;
    size_t left = (size_t)payload;
    while (left > 0) {
        if (left < 4)
            return GS_PARSE_ERROR; /* a field header running past the end */
        unsigned tag = (unsigned)get_le(p, 2);
        size_t n = (size_t)get_le(p + 2, 2);
        if (n > left - 4)
            return GS_PARSE_ERROR; /* a value running past the end */
        const uint8_t *v = p + 4;
        int type = tag <= GS_TAG_MAX ? tag_type[tag] : T_UNKNOWN;
        if (type == T_U64) {
            if (n != 8)
                return GS_PARSE_ERROR;
            msg->u64[tag] = get_le(v, 8);
            msg->have |= (uint64_t)1 << tag;
        } else if (type == T_STR) {
            msg->str[tag] = v;
            msg->str_len[tag] = (uint16_t)n;
            msg->have |= (uint64_t)1 << tag;
        } /* unknown tags are skipped: either side may add fields */
        p += 4 + n;
        left -= 4 + n;
    }
    *frame_len = GS_PROTO_HEADER + (size_t)payload;
    return GS_PARSE_OK;
}

int gs_msg_str(const struct gs_msg *m, int tag, char *dst, size_t cap)
{
    if (!cap)
        return 0;
    dst[0] = 0;
    if (!gs_msg_has(m, tag) || !m->str[tag])
        return 0;
    size_t n = m->str_len[tag];
    if (n > cap - 1)
        n = cap - 1;
    memcpy(dst, m->str[tag], n);
    dst[n] = 0;
    return 1;
}
