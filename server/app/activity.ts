/**
 * Whether any client is connected (a session, or a connection to the gRPC
 * socket). Busy polling and the event-loop delay sampler wake or keep the
 * loop running; with no client there is nothing for either to serve, so the
 * daemon runs them only while one is connected and sleeps in epoll otherwise.
 */
export class ClientActivity {
  // Invariant: connected counts the enter() calls whose returned leave has not run yet.
  private connected = 0;
  private stopped = false;

  /** @param onChange called with true when the first client connects, false when the last one leaves */
  constructor(private readonly onChange: (active: boolean) => void) {}

  /** A client connected; the function returned (which acts once) says it left. */
  enter(): () => void {
    if (++this.connected === 1 && !this.stopped) this.onChange(true);
    let left = false;
    return () => {
      if (left) return;
      left = true;
      if (--this.connected === 0 && !this.stopped) this.onChange(false);
    };
  }

  /** Whether a client is connected now. */
  get active(): boolean {
    return this.connected > 0;
  }

  /** From now on nothing is told: the daemon is stopping and has turned both off itself. */
  stop(): void {
    this.stopped = true;
  }

  /** Told again: the daemon serves again after a stop whose successor never came (it turns both on itself if a client is connected). */
  start(): void {
    this.stopped = false;
  }
}
