/*
 * What the memory engine needs from the client, the room above it: the engine's one door
 * upwards. The client implements these (client/session.c); the engine includes no header of
 * the client and calls nothing else of it, so that the call graph between files keeps no cycle
 * (tests/native/test_layering.py allows a call up a room only to a function declared here).
 */
#ifndef GPUSHARE_MEMORY_CLIENT_H
#define GPUSHARE_MEMORY_CLIENT_H

/* Wake the shim's thread (memory changed: a new MEMORY report is due). Async-signal-safe. */
void gs_client_wake(void);
/* Whether the NVML device with this UUID is the one the process uses (1 when none is known). */
int gs_client_device_matches_uuid(const char *nvml_uuid);
/* Whether the session started with a context on some device. */
int gs_client_has_context(void);

#endif /* GPUSHARE_MEMORY_CLIENT_H */
