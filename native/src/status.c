/* The public status API (native/include/gpushare.h), read by the %gpushare magic through cffi. */
#include <stddef.h>
#include <string.h>

#include "gpushare.h"
#include "shim.h"

GS_EXPORT int gpushare_get_status(struct gpushare_status *out, size_t size)
{
    /* Every field this library knows must fit: a caller built against an older, shorter struct
     * would otherwise get a partial copy it cannot tell from a full one. */
    if (!out || size < sizeof(struct gpushare_status))
        return -1;
    memset(out, 0, size);
    out->version = GPUSHARE_STATUS_VERSION;
    gs_client_status(out);
    return 0;
}

GS_EXPORT int gpushare_release(void) { return gs_client_release(); }

GS_EXPORT const char *gpushare_version(void) { return GS_VERSION; }
