/**
 * Who may call what on gRPC (docs/OPERATIONS.md, "Users, admins and limits").
 * Every call is attributed: on the Unix socket to its peer's uid and gid,
 * read with SO_PEERCRED on each connection the daemon accepts itself
 * (unix-listener.ts); over TCP to its client certificate. Then:
 * - the allow lists hold for every call, with a session or without;
 * - a session token works only from the uid that opened the session;
 * - calls without a session only inspect, unless the caller is an admin
 *   (--admin-uids / --admin-gids, root by default): what nobody's session
 *   holds is the daemon's, and only admins change it;
 * - daemon-wide operations (ClearCaches, GetReport) need an admin; listings
 *   show a non-admin only its own uid's sessions and objects;
 * - TCP without mutual TLS serves public inspection only (devices, memory
 *   info, stats, version); with mutual TLS the certificate's holder is an
 *   admin, as the operator who issued it chose (no sessions over TCP either way).
 */
import * as fs from 'node:fs';
import type { Credentials } from '../../../native';
import { permissionDenied, unauthenticated } from '../../errors';
import type { Session } from '../session/sessions';

/** Who is calling, as the connection says. */
export interface Caller {
  transport: 'unix' | 'tcp';
  /** The peer's credentials on the Unix socket. */
  peer?: Credentials;
  /** TCP with a client certificate the configured CA signed. */
  mutualTls: boolean;
  /** May act daemon-wide. */
  admin: boolean;
}

/** Calls that only inspect: open to every allowed caller, with or without a session. */
const INSPECTION = new Set([
  'ListDevices',
  'GetMemoryInfo',
  'GetGranularity',
  'GetStats',
  'GetVersion',
  'ListSessions',
  'ListObjects',
  'GetProperties',
  'GetAccess',
  'List',
  'Watch',
]);

/** Inspection that shows nothing of any user's objects: all that TCP without mutual TLS serves. */
const PUBLIC = new Set(['ListDevices', 'GetMemoryInfo', 'GetGranularity', 'GetStats', 'GetVersion']);

/** Daemon-wide operations: admins only. */
const ADMIN_ONLY = new Set(['ClearCaches', 'GetReport']);

/** The prefix of the remote address given to each accepted Unix-socket connection (what grpc-js reports as the call's peer). */
export const UNIX_PEER_PREFIX = 'unix-peer:';

/** The remote address an accepted Unix connection carries: its peer's credentials, supplementary groups included. */
export function unixPeerAddress(peer: Credentials): string {
  return `${UNIX_PEER_PREFIX}uid=${peer.uid},gid=${peer.gid},pid=${peer.pid},groups=${supplementaryGroups(peer).join(':')}`;
}

function parseUnixPeer(address: string): Credentials | undefined {
  const match = /^unix-peer:uid=(\d+),gid=(\d+),pid=(\d+),groups=([\d:]*)$/.exec(address);
  if (match === null) return undefined;
  return { uid: Number(match[1]), gid: Number(match[2]), pid: Number(match[3]), groups: match[4] === '' ? [] : match[4].split(':').map(Number) };
}

/**
 * The peer's supplementary groups: those the kernel gave with its credentials
 * (SO_PEERGROUPS), else, on a kernel without it, the Groups: line of
 * /proc/PID/status (none if unreadable). Groups are how users join the
 * socket's group (usermod -aG, Kubernetes supplementalGroups): SO_PEERCRED
 * has only the primary one.
 */
export function supplementaryGroups(peer: Credentials): number[] {
  if (peer.groups !== undefined) return peer.groups;
  try {
    const line = /^Groups:(.*)$/m.exec(fs.readFileSync(`/proc/${peer.pid}/status`, 'utf8'))?.[1] ?? '';
    peer.groups = line.trim() === '' ? [] : line.trim().split(/\s+/).map(Number);
  } catch {
    peer.groups = [];
  }
  return peer.groups;
}

/** "uid 1000 (gid 1000, groups 27, 2000)": who a peer is, as a refusal names it. */
export function describePeer(peer: Credentials): string {
  const groups = supplementaryGroups(peer);
  return `uid ${peer.uid} (gid ${peer.gid}${groups.length === 0 ? '' : `, groups ${groups.join(', ')}`})`;
}

/** Whether any of the peer's groups, primary or supplementary, is in `gids`. */
function inGroups(gids: number[], peer: Credentials): boolean {
  return gids.length > 0 && (gids.includes(peer.gid) || supplementaryGroups(peer).some((group) => gids.includes(group)));
}

/** The configured allow and admin lists, by uid or gid. */
export interface AccessLists {
  allowUids: number[];
  allowGids: number[];
  adminUids: number[];
  adminGids: number[];
}

/** Why a peer may not use the daemon under the allow lists, or undefined. */
export function authorize(config: Pick<AccessLists, 'allowUids' | 'allowGids'>, peer: Credentials): string | undefined {
  if (config.allowUids.length === 0 && config.allowGids.length === 0) return undefined;
  if (config.allowUids.includes(peer.uid) || inGroups(config.allowGids, peer)) return undefined;
  return `${describePeer(peer)} is not allowed: allowed uids [${config.allowUids.join(', ')}], gids [${config.allowGids.join(', ')}]`;
}

export class AccessPolicy {
  constructor(private readonly config: AccessLists) {}

  /** Whether the peer's uid, or any of its groups (primary or supplementary), is an admin's. */
  isAdmin(peer: Credentials): boolean {
    return this.config.adminUids.includes(peer.uid) || inGroups(this.config.adminGids, peer);
  }

  /** Why a peer may not open a session or call at all, or undefined. Admins are always allowed. */
  refusal(peer: Credentials): string | undefined {
    return this.isAdmin(peer) ? undefined : authorize(this.config, peer);
  }

  /** The caller of a call, from grpc-js's peer text and auth context. */
  identify(peerText: string, auth: { sslPeerCertificate?: unknown }): Caller {
    const peer = parseUnixPeer(peerText);
    if (peer !== undefined) return { transport: 'unix', peer, mutualTls: false, admin: this.isAdmin(peer) };
    // Every Unix connection is accepted by the daemon and named; anything else came over TCP.
    const mutualTls = auth.sslPeerCertificate !== undefined;
    return { transport: 'tcp', mutualTls, admin: mutualTls };
  }

  /**
   * Checks a request on the session socket as the RPC of the same name: its
   * caller is the session's peer, on the Unix socket, with the session's token.
   * @throws as check()
   */
  checkSession(method: string, session: Session): void {
    this.check(method, this.sessionCaller(session), session.token, () => session);
  }

  /** The caller of a session-socket request: the session's peer, on the Unix socket. */
  sessionCaller(session: Session): Caller {
    return { transport: 'unix', peer: session.peer, mutualTls: false, admin: this.isAdmin(session.peer) };
  }

  /**
   * Checks a call before it runs.
   * @throws PERMISSION_DENIED NOT_ALLOWED, NEEDS_ADMIN, TCP_INSPECTION_ONLY, SESSION_OF_ANOTHER_UID;
   *   UNAUTHENTICATED TCP_SESSION
   */
  check(method: string, caller: Caller, token: string | undefined, session: () => Session | undefined): void {
    if (caller.transport === 'tcp') {
      if (token !== undefined) {
        throw unauthenticated('TCP_SESSION', 'sessions and descriptors exist only over the Unix socket; call without a session token over TCP');
      }
      if (!caller.mutualTls && !PUBLIC.has(method)) {
        throw permissionDenied(
          'TCP_INSPECTION_ONLY',
          `${method} is not served over TCP without a client certificate: only ${[...PUBLIC].join(', ')} are (set --tls-ca for mutual TLS, or use the Unix socket)`,
        );
      }
      return;
    }
    const peer = caller.peer!;
    const refused = this.refusal(peer);
    if (refused !== undefined) throw permissionDenied('NOT_ALLOWED', refused);
    const own = session();
    if (own !== undefined && own.peer.uid !== peer.uid) {
      throw permissionDenied(
        'SESSION_OF_ANOTHER_UID',
        `session ${own.id} was opened by uid ${own.peer.uid}; its token works only for that uid, not for uid ${peer.uid}`,
      );
    }
    if (caller.admin) return;
    if (ADMIN_ONLY.has(method)) {
      throw permissionDenied(
        'NEEDS_ADMIN',
        `${method} acts daemon-wide and needs an admin uid or gid (--admin-uids, --admin-gids); ${describePeer(peer)} is not one`,
      );
    }
    if (own === undefined && !INSPECTION.has(method)) {
      throw permissionDenied(
        'NEEDS_ADMIN',
        `${method} without a session needs an admin uid or gid (--admin-uids, --admin-gids); open a session (the session socket) to make and change objects of your own`,
      );
    }
  }
}
