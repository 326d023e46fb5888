/**
 * systemd's notification protocol without libsystemd: READY=1 once serving,
 * STOPPING=1 on SIGTERM, WATCHDOG=1 every half WatchdogSec while running. A
 * daemon not started by systemd (no NOTIFY_SOCKET) sends nothing.
 */
import type { Logger } from 'pino';
import { addon } from '../../native';

export class Notifier {
  private readonly socket: string | undefined;
  private watchdog?: NodeJS.Timeout;

  constructor(
    private readonly env: NodeJS.ProcessEnv,
    private readonly log: Logger,
  ) {
    this.socket = env.NOTIFY_SOCKET || undefined;
  }

  /** Sends one notification; a failure is logged, never fatal. */
  notify(message: string): void {
    if (this.socket === undefined) return;
    try {
      addon.unixDgramSend(this.socket, Buffer.from(message));
    } catch (error) {
      this.log.warn({ err: error, socket: this.socket }, `sd_notify ${message} failed`);
    }
  }

  ready(status: string): void {
    this.notify(`READY=1\nSTATUS=${status}\nMAINPID=${process.pid}`);
    this.startWatchdog();
  }

  stopping(): void {
    if (this.watchdog) clearInterval(this.watchdog);
    this.notify('STOPPING=1');
  }

  private startWatchdog(): void {
    const usec = Number(this.env.WATCHDOG_USEC);
    if (!Number.isFinite(usec) || usec <= 0) return;
    // WATCHDOG_PID, when set, names the process the watchdog is for.
    if (this.env.WATCHDOG_PID && Number(this.env.WATCHDOG_PID) !== process.pid) return;
    const intervalMs = Math.max(1, Math.floor(usec / 2000));
    this.watchdog = setInterval(() => this.notify('WATCHDOG=1'), intervalMs);
    this.watchdog.unref();
    this.notify('WATCHDOG=1');
  }
}
