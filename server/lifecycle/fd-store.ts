/**
 * The service manager's file-descriptor store, as the daemon speaks to it:
 * `FDSTORE=1` + `FDNAME=` datagrams carrying descriptors to NOTIFY_SOCKET
 * (sd_pid_notify_with_fds), `FDSTOREREMOVE=1` when an object is gone, and at
 * start the descriptors handed back as LISTEN_FDS / LISTEN_FDNAMES from fd 3
 * on (sd_listen_fds_with_names). systemd and vmmd's keeper
 * (server/lifecycle/keeper.ts) both answer this protocol.
 */
import { addon } from '../../native';

/** The first descriptor sd_listen_fds hands over (SD_LISTEN_FDS_START). */
export const LISTEN_FDS_START = 3;

/** The longest name systemd accepts in FDNAME= (FDNAME_MAX). */
const FDNAME_MAX = 255;

/** A name systemd accepts: printable ASCII without ':' (the separator of LISTEN_FDNAMES), at most 255 bytes. */
export function isValidFdName(name: string): boolean {
  return name.length > 0 && name.length <= FDNAME_MAX && /^[\x21-\x39\x3b-\x7e]+$/.test(name);
}

/**
 * Where parked descriptors go, by name: a service manager's file-descriptor
 * store (FdStoreClient), or the daemon's own hold (HeldDescriptors) where
 * none runs and a successor takes them over.
 */
export interface DescriptorParking {
  /** Keeps a copy of `fd` under `name` (the caller keeps fd). @throws the store's error: nothing is kept */
  store(name: string, fd: number): void;
  /** Drops every descriptor kept under `name`. @throws the store's error */
  remove(name: string): void;
}

export class FdStoreClient implements DescriptorParking {
  // One socket connected to the store for the process's life: a notification is one sendmsg, not three system calls.
  private connected?: number;

  constructor(private readonly socket: string) {}

  /**
   * Stores one descriptor under `name` (the store keeps its own copy; the
   * caller keeps fd). Returns once the datagram is sent: the store has it.
   * @throws the send's error (ENOENT, ECONNREFUSED: nothing is stored)
   */
  store(name: string, fd: number): void {
    this.send(`FDSTORE=1\nFDNAME=${name}`, [fd]);
  }

  /** Drops every descriptor stored under `name`. @throws the send's error */
  remove(name: string): void {
    this.send(`FDSTOREREMOVE=1\nFDNAME=${name}`, []);
  }

  private send(text: string, fds: number[]): void {
    this.connected ??= addon.unixDgramConnect(this.socket);
    try {
      addon.unixDgramSendFds(this.connected, Buffer.from(text), fds);
    } catch {
      // The store's socket was replaced (a service manager re-executed): connect again once.
      addon.close(this.connected);
      this.connected = addon.unixDgramConnect(this.socket);
      addon.unixDgramSendFds(this.connected, Buffer.from(text), fds);
    }
  }
}

/**
 * The descriptors the service manager handed this process at start, by name
 * (several may share one), as sd_listen_fds_with_names reads them: only when
 * LISTEN_PID is this process. The variables are removed from `env`, so that
 * children do not take them for theirs; the descriptors become close-on-exec.
 */
export function inheritedDescriptors(env: NodeJS.ProcessEnv, pid = process.pid): Map<string, number[]> {
  const count = Number(env.LISTEN_FDS ?? '0');
  const forUs = env.LISTEN_PID !== undefined && Number(env.LISTEN_PID) === pid;
  const names = (env.LISTEN_FDNAMES ?? '').split(':');
  delete env.LISTEN_FDS;
  delete env.LISTEN_PID;
  delete env.LISTEN_FDNAMES;
  const found = new Map<string, number[]>();
  if (!forUs || !Number.isInteger(count) || count <= 0) return found;
  for (let index = 0; index < count; index++) {
    const fd = LISTEN_FDS_START + index;
    addon.setCloseOnExec(fd, true);
    const name = names[index] || 'unknown';
    const list = found.get(name) ?? [];
    list.push(fd);
    found.set(name, list);
  }
  return found;
}
