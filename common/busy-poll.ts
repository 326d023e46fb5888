/**
 * The default budget of busy polling (native/busy-poll.ts), the daemon's and
 * the client's: how long an event loop spins for the next message before it
 * sleeps. 200 us covers a daemon's answer (20-90 us) and a client's import and
 * map between two requests of a cold allocation (~100-150 us on an H100).
 */
export const DEFAULT_BUSY_POLL_MICROS = 200;
