/**
 * The backend interface: the shape of the CUDA driver's VMM API, implemented
 * by the cuda backend over the driver and by the host backend over memfd and
 * mmap. Backends hold no policy: the registry has validated every argument
 * before a backend sees it. Slow operations return promises.
 */

export type LocationKind = 'DEVICE' | 'HOST' | 'HOST_NUMA';

export interface MemLocation {
  type: LocationKind;
  id: number;
}

export type HandleKind = 'POSIX_FD' | 'FABRIC';

/** Access flags, as bits: READ 1, READWRITE 3. */
export type Access = 0 | 1 | 3;
export const ACCESS_NONE: Access = 0;
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
}

export interface MemoryInfo {
  freeBytes: bigint;
  totalBytes: bigint;
}

/** A backend's handle to physical memory (a memfd, a CUmemGenericAllocationHandle). */
export type BackendHandle = number | bigint;

export interface ImportedHandle {
  handle: BackendHandle;
  size: bigint;
  device: number;
  location: MemLocation;
}

export interface Backend {
  readonly name: 'host' | 'cuda';
  devices(): DeviceInfo[];
  memoryInfo(device: number): MemoryInfo;
  /** Address space only: PROT_NONE / cuMemAddressReserve. */
  reserve(size: bigint, alignment: bigint, hint: bigint): bigint;
  freeAddress(address: bigint, size: bigint): void;
  /** @throws an error with code OUT_OF_MEMORY or CUDA_ERROR_OUT_OF_MEMORY */
  create(device: number, location: MemLocation, size: bigint): BackendHandle;
  release(handle: BackendHandle, size: bigint, imported: boolean): Promise<void>;
  map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): void;
  unmap(address: bigint, size: bigint): Promise<void>;
  setAccess(address: bigint, size: bigint, grants: AccessGrant[]): void;
  /** A new descriptor for the handle, owned by the caller. */
  exportHandle(handle: BackendHandle): Promise<number>;
  /**
   * A handle from a received descriptor; the backend takes ownership of fd.
   * @throws an error with code BAD_DESCRIPTOR when fd is not memory of this backend
   */
  importHandle(fd: number): ImportedHandle;
  readBytes(address: bigint, length: number): Promise<Buffer>;
  writeBytes(address: bigint, data: Buffer): Promise<void>;
  close(): void;
}

export function sameLocation(a: MemLocation, b: MemLocation): boolean {
  return a.type === b.type && a.id === b.id;
}

export function describeLocation(location: MemLocation): string {
  return `${location.type}:${location.id}`;
}
