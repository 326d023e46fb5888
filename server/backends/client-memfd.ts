/**
 * What a client's memfd must be before the daemon maps it (a staging buffer,
 * a SYSMEM attachment, an Import on the host backend). The daemon touches
 * those pages from its own threads: a memfd its sender can still shrink turns
 * the next copy into SIGBUS for the whole daemon, one it can grow keeps more
 * memory alive than the quotas and the capacity counted, one that others may
 * write lets any uid handed a read-only descriptor of it reopen it writable,
 * and a descriptor whose mode or seals forbid the mapping asked for fails
 * later, inside a copy or an mprotect. So every rule is checked here, once, when the descriptor arrives,
 * and a refusal says what the descriptor lacks (docs/PROTOCOL.md, "Client
 * memory").
 */
import { ACCESS_MODE, addon, FdInfo, MEMFD_SEALS } from '../../native';
import { invalidArgument, RpcError } from '../errors';

export interface ClientMemfdUse {
  /** What the descriptor is for, as the refusal names it ("a staging buffer"). */
  what: string;
  /** The daemon maps it writable (or hands it out writable). */
  writable: boolean;
  /** The daemon seals it against writes (a read-only attachment): sealing must still be allowed. */
  sealReadOnly?: boolean;
  /** The daemon hands descriptors of it to other sessions, other uids' among them (an attachment, an import). */
  handedOut?: boolean;
  /** The daemon reopens it read-only for other uids' opens (an attachment): it must be able to read the file. */
  reopenedReadOnly?: boolean;
}

/** The seals every client memfd the daemon maps carries: it can neither shrink under the daemon's mappings nor grow past what was counted. */
const RESIZE_SEALS = MEMFD_SEALS.SHRINK | MEMFD_SEALS.GROW;
/** Write permission for group and others: with it, a holder of a read-only descriptor can reopen the memfd writable through /proc/self/fd. */
const OTHERS_WRITE = 0o022;

const badDescriptor = (what: string, rule: string) => invalidArgument('BAD_DESCRIPTOR', `${what}: ${rule}`);

function sealNames(seals: number): string {
  const names = Object.entries(MEMFD_SEALS)
    .filter(([, bit]) => (seals & bit) !== 0)
    .map(([name]) => `F_SEAL_${name}`);
  return names.length === 0 ? 'no seals' : names.join('|');
}

/**
 * Checks a client's memfd for a use and makes it safe to map: when it lacks
 * F_SEAL_SHRINK or F_SEAL_GROW and sealing is still allowed, the seals are
 * added (the sender can never resize it again: neither SIGBUS under the
 * daemon's mappings nor memory past what the quotas and the capacity
 * counted); its size is read after that, so a resize racing the check cannot
 * slip through. One handed out to others loses write permission for group
 * and others (owner-only writes; the daemon, another uid, still reopens it
 * read-only). The caller keeps fd (and closes it on a throw).
 * @returns the descriptor's information, size as sealed
 * @throws INVALID_ARGUMENT BAD_DESCRIPTOR naming what the descriptor lacks
 */
export function admitClientMemfd(fd: number, use: ClientMemfdUse): FdInfo {
  let info: FdInfo;
  try {
    info = addon.hostFdInfo(fd);
  } catch (error) {
    throw badDescriptor(use.what, `the descriptor cannot be inspected (${(error as Error).message})`);
  }
  if (!info.memfd) throw badDescriptor(use.what, 'must be a memfd (this descriptor does not answer F_GET_SEALS)');
  if (info.accessMode === ACCESS_MODE.O_WRONLY) {
    throw badDescriptor(use.what, 'the descriptor is open write-only (O_WRONLY); mapping it needs O_RDWR (or O_RDONLY for read-only use)');
  }
  if (use.writable && info.accessMode !== ACCESS_MODE.O_RDWR) {
    throw badDescriptor(use.what, 'the descriptor is open read-only (O_RDONLY); the daemon maps it writable and needs O_RDWR');
  }
  const writeSeals = info.seals & (MEMFD_SEALS.WRITE | MEMFD_SEALS.FUTURE_WRITE);
  if (use.writable && writeSeals !== 0) {
    throw badDescriptor(use.what, `the memfd is sealed ${sealNames(writeSeals)}, so it cannot be mapped writable`);
  }
  const sealable = (info.seals & MEMFD_SEALS.SEAL) === 0;
  if (use.sealReadOnly && !sealable) {
    throw badDescriptor(
      use.what,
      `read-only use seals the memfd F_SEAL_FUTURE_WRITE, but it takes no more seals (${sealNames(info.seals)}: created without MFD_ALLOW_SEALING, or sealed F_SEAL_SEAL)`,
    );
  }
  if (use.sealReadOnly && info.accessMode !== ACCESS_MODE.O_RDWR) {
    throw badDescriptor(
      use.what,
      'read-only use seals the memfd F_SEAL_FUTURE_WRITE, which the kernel allows only through a descriptor open O_RDWR (this one is O_RDONLY)',
    );
  }
  const missing = RESIZE_SEALS & ~info.seals;
  if (missing !== 0) {
    if (info.accessMode !== ACCESS_MODE.O_RDWR) {
      throw badDescriptor(
        use.what,
        `the memfd must be sealed ${sealNames(missing)}, and a descriptor open O_RDONLY cannot add the seal: seal it before sending, or send it O_RDWR`,
      );
    }
    if (!sealable) {
      throw badDescriptor(
        use.what,
        `the memfd must be sealed ${sealNames(missing)} (it has ${sealNames(info.seals)}, and F_SEAL_SEAL forbids adding it: create it with MFD_ALLOW_SEALING, or seal it F_SEAL_SHRINK|F_SEAL_GROW before sending)`,
      );
    }
    try {
      addon.hostMemfdAddSeals(fd, missing);
      info = addon.hostFdInfo(fd);
    } catch (error) {
      if (error instanceof RpcError) throw error;
      throw badDescriptor(use.what, `${sealNames(missing)} could not be added (${(error as Error).message})`);
    }
  }
  if (use.handedOut && (info.mode & OTHERS_WRITE) !== 0) {
    const narrowed = info.mode & ~OTHERS_WRITE;
    try {
      addon.hostFchmod(fd, narrowed);
    } catch (error) {
      throw badDescriptor(
        use.what,
        `the memfd's mode 0${info.mode.toString(8)} lets any uid that gets a read-only descriptor of it reopen it writable (open /proc/self/fd/N O_RDWR), and the daemon cannot narrow it (${(error as Error).message}): fchmod it 0644 before sending`,
      );
    }
    info = { ...info, mode: narrowed };
  }
  if (use.reopenedReadOnly && !daemonMayRead(info)) {
    throw badDescriptor(
      use.what,
      `other uids' opens get a read-only descriptor the daemon (uid ${process.geteuid?.()}) reopens through /proc/self/fd, and the memfd's mode 0${info.mode.toString(8)} (owner uid ${info.uid}) does not let it read the file: fchmod it 0644 before sending`,
    );
  }
  return info;
}

/** Whether this process may open the file for reading by its permission bits (its owner, root, or read for others). */
function daemonMayRead(info: Pick<FdInfo, 'mode' | 'uid'>): boolean {
  const uid = process.geteuid?.();
  return uid === 0 || uid === info.uid || (info.mode & 0o004) !== 0;
}

/** The file a memfd descriptor opens, as backends name physical memory (Backend.memoryIdentity): equal for every descriptor of it. */
export function memfdIdentity(info: Pick<FdInfo, 'device' | 'inode'>): string {
  return `memfd:${info.device}:${info.inode}`;
}
