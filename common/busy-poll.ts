/**
 * The default budget of busy polling (native/busy-poll.ts), the daemon's and
 * the client's: how long an event loop spins for the next message before it
 * sleeps. It covers a daemon's answer and a client's import and map between
 * two requests of a cold allocation (BENCHMARKS.md has the measured times).
 */
export const DEFAULT_BUSY_POLL_MICROS = 200;
