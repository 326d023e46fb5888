/**
 * Busy polling of this thread's event loop (native/src/busy_poll.cc): before
 * the loop sleeps in epoll it spins, at most a budget, for whatever comes
 * next. Between two processes that both spin, a session round trip skips the
 * two wake-ups a sleeping pair pays (on a virtual machine each is an
 * interrupt the hypervisor delivers, slow beside the round trip's own work).
 * The daemon spins always (its budget, --busy-poll-us); a client spins only
 * while a request of its is waiting for its answer (want()).
 */
import { addon } from './index';

export { DEFAULT_BUSY_POLL_MICROS } from '../common/busy-poll';

let budget = 0;
let wanting = 0;
let wantedMicros = 0;

/** Spins up to `micros` before every sleep from now on (0: never), whoever wants it. */
export function busyPollAlways(micros: number): void {
  budget = micros;
  apply();
}

/**
 * Spins up to `micros` before each sleep until the returned function is
 * called (each call of it once): a client while its request is in flight.
 * Several at once spin with the largest budget asked.
 */
export function busyPollWhile(micros: number): () => void {
  if (micros <= 0) return () => {};
  wanting++;
  const before = wantedMicros;
  wantedMicros = Math.max(wantedMicros, micros);
  if (wanting === 1 || wantedMicros !== before) apply();
  let done = false;
  return () => {
    if (done) return;
    done = true;
    if (--wanting === 0) {
      wantedMicros = 0;
      apply();
    }
  };
}

/** Spins begun before a sleep, those that met something ready, and the time spun (this thread). */
export function busyPollStats(): { spins: number; caught: number; spunMicroseconds: number } {
  return addon.busyPollStats();
}

function apply(): void {
  addon.busyPoll(Math.max(budget, wanting > 0 ? wantedMicros : 0));
}
