/* The thread-local last-error message (bn_fail, bitnet_get_last_error) and the version. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[1024];

bitnet_status bn_fail(bitnet_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

bitnet_status bitnet_get_last_error(const char **message) {
    if (!message) return bn_fail(BITNET_ERR_INVALID_ARGUMENT, "bitnet_get_last_error: message is NULL");
    *message = last_error;
    return BITNET_OK;
}

bitnet_status bitnet_get_version(int32_t *major, int32_t *minor, int32_t *patch) {
    BN_CHECK(major && minor && patch, "bitnet_get_version: NULL output pointer");
    *major = BITNET_VERSION_MAJOR;
    *minor = BITNET_VERSION_MINOR;
    *patch = BITNET_VERSION_PATCH;
    return BITNET_OK;
}
