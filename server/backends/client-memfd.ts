/**
 * What a client's memfd must be before the daemon maps it (a staging buffer,
 * a SYSMEM attachment, an Import on the host backend). The daemon touches
 * those pages from its own threads: a memfd its sender can still shrink turns
 * the next copy into SIGBUS for the whole daemon, and a descriptor whose mode
 * or seals forbid the mapping asked for fails later, inside a copy or an
 * mprotect. So every rule is checked here, once, when the descriptor arrives,
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
}

const badDescriptor = (what: string, rule: string) => invalidArgument('BAD_DESCRIPTOR', `${what}: ${rule}`);

function sealNames(seals: number): string {
  const names = Object.entries(MEMFD_SEALS)
    .filter(([, bit]) => (seals & bit) !== 0)
    .map(([name]) => `F_SEAL_${name}`);
  return names.length === 0 ? 'no seals' : names.join('|');
}

/**
 * Checks a client's memfd for a use and makes it safe to map: when it lacks
 * F_SEAL_SHRINK and sealing is still allowed, the seal is added (the sender
 * can never shrink it again); its size is read after that, so a shrink racing
 * the check cannot slip through. The caller keeps fd (and closes it on a throw).
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
    throw badDescriptor(use.what, 'read-only use seals the memfd F_SEAL_FUTURE_WRITE, which the kernel allows only through a descriptor open O_RDWR (this one is O_RDONLY)');
  }
  if ((info.seals & MEMFD_SEALS.SHRINK) === 0) {
    if (info.accessMode !== ACCESS_MODE.O_RDWR) {
      throw badDescriptor(use.what, 'the memfd must be sealed F_SEAL_SHRINK, and a descriptor open O_RDONLY cannot add the seal: seal it before sending, or send it O_RDWR');
    }
    if (!sealable) {
      throw badDescriptor(
        use.what,
        `the memfd must be sealed F_SEAL_SHRINK (it has ${sealNames(info.seals)}, and F_SEAL_SEAL forbids adding it: create it with MFD_ALLOW_SEALING, or seal it F_SEAL_SHRINK before sending)`,
      );
    }
    try {
      addon.hostMemfdAddSeals(fd, MEMFD_SEALS.SHRINK);
      info = addon.hostFdInfo(fd);
    } catch (error) {
      if (error instanceof RpcError) throw error;
      throw badDescriptor(use.what, `F_SEAL_SHRINK could not be added (${(error as Error).message})`);
    }
  }
  return info;
}

/** The file a memfd descriptor opens, as backends name physical memory (Backend.memoryIdentity): equal for every descriptor of it. */
export function memfdIdentity(info: Pick<FdInfo, 'device' | 'inode'>): string {
  return `memfd:${info.device}:${info.inode}`;
}
