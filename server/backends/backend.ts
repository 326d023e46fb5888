/**
 * The backend interface: the shape of the CUDA driver's VMM API, implemented
 * by the cuda backend over the driver and by the host backend over memfd and
 * mmap. Backends hold no policy: the registry has validated every argument
 * before a backend sees it. Slow operations return promises.
 */
import type { ErrorCode } from '../../common/error-codes';

export type LocationKind = 'DEVICE' | 'HOST' | 'HOST_NUMA';

export interface MemLocation {
  type: LocationKind;
  id: number;
}

export type HandleKind = 'POSIX_FD' | 'FABRIC';

/** Access flags, as bits: READ 1, READWRITE 3. */
export type Access = 0 | 1 | 3;
export const ACCESS_READ: Access = 1;
export const ACCESS_READWRITE: Access = 3;

export interface AccessGrant {
  location: MemLocation;
  access: Access;
}

export interface DeviceInfo {
  index: number;
  name: string;
  kind: 'HOST' | 'CUDA';
  uuid: string;
  totalBytes: bigint;
  granularityMinimum: bigint;
  granularityRecommended: bigint;
  handleTypes: HandleKind[];
  computeCapability: string;
  /** Whether fabric handles work (probed at start), and the reason when not. */
  fabricUsable: boolean;
  fabricStatus: string;
  hostNumaId: number;
}

export interface MemoryInfo {
  freeBytes: bigint;
  totalBytes: bigint;
}

/** A backend's handle to physical memory (a memfd, a CUmemGenericAllocationHandle). */
export type BackendHandle = number | bigint;

/** What travels out of the daemon for an allocation: a descriptor, or fabric bytes. */
export type ImportSource = { fd: number } | { fabric: Buffer };

export interface ImportedHandle {
  handle: BackendHandle;
  size: bigint;
  device: number;
  location: MemLocation;
}

/** What differs between backends, asked by capability rather than by name. */
export interface BackendCapabilities {
  /** Host memory may name NUMA nodes other than 0 (cuda's HOST_NUMA ids); the host backend has node 0 only. */
  readonly hostNumaNodes: boolean;
  /** DEVICE memory is a GPU's own (frame buffer: FBMEM stores, ZCMEM); on the host backend it is system memory. */
  readonly gpuMemory: boolean;
  /** An exported descriptor can be narrowed to read-only (a memfd reopened O_RDONLY); a CUDA handle cannot. */
  readonly readOnlyExports: boolean;
  /** What an exported descriptor is: a memfd to mmap, or a CUDA handle to import with the driver. */
  readonly descriptors: 'memfd' | 'cuda';
}

export interface Backend {
  /** For logs and reports only: code asks `capabilities`. */
  readonly name: 'host' | 'cuda';
  readonly capabilities: BackendCapabilities;
  devices(): DeviceInfo[];
  memoryInfo(device: number): MemoryInfo;
  /** Granularity of memory at a location (cuMemGetAllocationGranularity). */
  granularity(location: MemLocation): { minimum: bigint; recommended: bigint };
  /** Whether `device` can be given access to memory of `owner` (peer access). */
  canAccessPeer(device: number, owner: number): boolean;
  /** Address space only: PROT_NONE / cuMemAddressReserve. */
  reserve(size: bigint, alignment: bigint, hint: bigint): bigint;
  freeAddress(address: bigint, size: bigint): void;
  /**
   * New physical memory of `size` bytes at `location`. Off the event loop where
   * the backend can (cuda: a driver thread with the device's primary context).
   * @throws an error with code OUT_OF_MEMORY or CUDA_ERROR_OUT_OF_MEMORY
   */
  create(device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle>;
  /**
   * create() and exportHandle() together, off the event loop where the
   * backend can (cuda: one job on a driver thread). What the stock refills with.
   */
  createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }>;
  /**
   * Frees the handle's last reference (the memory goes once unmapped everywhere); `device` is the memory's.
   * `awaited`: the caller waits for this free (a Release RPC, a reclaim, a rollback). Otherwise nobody
   * does (a session-socket release, answered before its free), and a backend may hold it back to run
   * later in a batch (server/backends/stock.ts holds such frees until the daemon is quiet).
   */
  release(handle: BackendHandle, size: bigint, imported: boolean, device: number, awaited?: boolean): Promise<void>;
  /**
   * Someone waits for the frees in flight (a request over its quota or out of
   * memory, a reclaim, the daemon stopping): a backend that holds frees back
   * lets them go now. Resolves once every release given to the backend before
   * the call has settled, done or failed (never rejects). Backends that hold
   * nothing back leave it out.
   */
  settleReleases?(): Promise<void>;
  /**
   * One more driver reference to the handle mapped at `address`
   * (cuMemRetainAllocationHandle); returns the handle the driver names.
   */
  retainHandle(address: bigint, handle: BackendHandle): BackendHandle;
  /** Drops one reference taken by retainHandle. */
  releaseReference(handle: BackendHandle, device: number): Promise<void>;
  /** Off the event loop where the backend can (cuda: a driver thread). */
  map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): Promise<void>;
  /** `device`: the mapped memory's (cuda: the work runs in that device's primary context). */
  unmap(address: bigint, size: bigint, device: number): Promise<void>;
  /** Off the event loop where the backend can (cuda: a driver thread). */
  setAccess(address: bigint, size: bigint, grants: AccessGrant[]): Promise<void>;
  /** A new descriptor for the handle (memory of `device`), owned by the caller. */
  exportHandle(handle: BackendHandle, device: number): Promise<number>;
  /**
   * From now on the memory cannot be mapped writable through any descriptor
   * (host: F_SEAL_FUTURE_WRITE). Backends that cannot enforce it (cuda:
   * access flags are the importer's) do nothing.
   */
  sealReadOnly(handle: BackendHandle): void;
  /**
   * From now on no descriptor of the memory can add seals (host: F_SEAL_SEAL
   * on the memfd; its growth and shrinking are sealed already): what the
   * daemon does before a descriptor goes to a session that does not own the
   * memory, so that no holder can seal it against its owner's writes. The
   * memory can no longer be sealed read-only afterwards. Backends whose
   * handles take no seals (cuda) leave it out.
   */
  freezeSeals?(handle: BackendHandle): void;
  /**
   * The physical memory a live handle names, as a string equal for every
   * handle of the same memory however it came in (created here, imported
   * from a descriptor this daemon exported, imported twice): what quotas count
   * memory by (server/registry/quotas.ts). Host: the memfd's file (st_dev, st_ino).
   * Cuda: memory this daemon created is known by its creation; memory it did
   * not create is its own identity, charged by the size its sender gave.
   */
  memoryIdentity(handle: BackendHandle, device: number): string;
  /**
   * A client's memfd the daemon maps outside the registry (a SYSMEM store),
   * counted with the rest of the backend's memory where the backend keeps a
   * capacity (host), once however many holds name it; dropClientMemfd undoes one hold.
   * @returns the memfd's identity (as memoryIdentity names it)
   * @throws an error with code OUT_OF_MEMORY when it would take the host backend past its capacity
   *   (once what the backend holds for speed was given back: server/backends/stock.ts)
   */
  holdClientMemfd(fd: number, size: bigint): Promise<string>;
  dropClientMemfd(identity: string): void;
  /** The handle as fabric bytes (cuda, where the host permits fabric handles). */
  exportFabric(handle: BackendHandle, device: number): Promise<Buffer>;
  /**
   * A handle from a received descriptor (the backend takes ownership of fd) or
   * from fabric bytes. `size` is what the sender says it is (0: unknown).
   * Off the event loop where the backend can (cuda: a driver thread).
   * @throws an error with code BAD_DESCRIPTOR when the source is not memory of this backend
   */
  importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle>;
  /**
   * Takes back memory an earlier daemon process parked (server/lifecycle/):
   * a descriptor this backend exported, with the size it had. The backend
   * takes ownership of fd. Unlike importHandle, the memory is the daemon's
   * own as before (a read-only store's sealed memfd included), not a client's.
   * Backends without it cannot restart without loss.
   * @throws an error with code BAD_DESCRIPTOR when fd is not such memory
   */
  restoreHandle?(fd: number, size: bigint): Promise<ImportedHandle>;
  /** Copies out of mapped memory, through `device` (which has access to it), into a new Buffer or into `into`. */
  readBytes(address: bigint, length: number, device: number, into?: Buffer): Promise<Buffer>;
  /** Copies into mapped memory, through `device` (which has write access to it). */
  writeBytes(address: bigint, data: Buffer, device: number): Promise<void>;
  /** Gives back what the backend holds; where it has driver work in flight, resolves once that has settled (the process may exit then). */
  close(): void | Promise<void>;
}

/** An error with a declared string code, as the addon throws them (server/errors.ts maps each to its status). */
export function codedError(code: ErrorCode, message: string, extra: Record<string, unknown> = {}): Error {
  return Object.assign(new Error(message), { code }, extra);
}

export function describeLocation(location: MemLocation): string {
  return `${location.type}:${location.id}`;
}
