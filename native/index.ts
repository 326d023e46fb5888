/**
 * The one loader of the vmmd addon. Every other module imports the addon from
 * here, typed; a failure to load is one actionable error.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';

/** An error thrown by the addon: `code` is a name ("ENOMEM"), never a number. */
export interface NativeError extends Error {
  code: string;
  errno?: number;
  result?: number;
  syscall?: string;
}

export interface FdInfo {
  size: bigint;
  regular: boolean;
  memfd: boolean;
  seals: number;
  readOnlySealed: boolean;
  accessMode: number;
  /** The file's permission bits (st_mode & 07777) and owner. */
  mode: number;
  uid: number;
  inode: bigint;
  /** st_dev: with the inode, which file this is (two descriptors of one memfd have both equal). */
  device: bigint;
}

export interface Credentials {
  pid: number;
  uid: number;
  gid: number;
  /** The peer's supplementary groups (SO_PEERGROUPS); absent where the kernel cannot say (before Linux 4.13). */
  groups?: number[];
}

export type Received = { eof: true } | { eof?: undefined; data: Buffer; fd: number; extraFds: number; truncated: boolean; controlTruncated: boolean };

export interface Poller {
  start(): void;
  stop(): void;
  close(): void;
  ref(): void;
  unref(): void;
}

/** memfd seal bits (fcntl F_GET_SEALS / F_ADD_SEALS). */
export const MEMFD_SEALS = { SEAL: 0x1, SHRINK: 0x2, GROW: 0x4, WRITE: 0x8, FUTURE_WRITE: 0x10 } as const;

/** Access modes of a descriptor (F_GETFL & O_ACCMODE). */
export const ACCESS_MODE = { O_RDONLY: 0, O_WRONLY: 1, O_RDWR: 2 } as const;

/** Access bits for hostProtect: read 1, write 2. */
export const HOST_ACCESS = { NONE: 0, READ: 1, READWRITE: 3 } as const;

export interface CudaLoadResult {
  loaded: boolean;
  reason: string;
  driverVersion: number;
  deviceCount: number;
}

export interface CudaDeviceInfo {
  index: number;
  name: string;
  uuid: string;
  totalBytes: bigint;
  computeCapability: string;
  vmm: boolean;
  posixFd: boolean;
  fabric: boolean;
  hostNumaId: number;
}

/** CUmemLocationType values. */
export const CU_LOCATION = { DEVICE: 1, HOST: 2, HOST_NUMA: 3 } as const;
/** CUmemAllocationHandleType bits. */
export const CU_HANDLE = { POSIX_FD: 0x1, FABRIC: 0x8 } as const;

export interface Addon {
  /** A memfd sealed F_SEAL_SHRINK | F_SEAL_GROW, with permission bits `mode` (default 0o600: owner only). */
  hostMemfdCreate(name: string, size: bigint, mode?: number): number;
  /** fchmod as asked. */
  hostFchmod(fd: number, mode: number): void;
  hostMemfdSealReadOnly(fd: number): void;
  /** Diagnostic (tests): a memfd with no seals, sealable only with allowSealing (MFD_ALLOW_SEALING). */
  _memfdCreate(name: string, size: bigint, allowSealing: boolean): number;
  /** F_ADD_SEALS with these bits (MEMFD_SEALS). */
  hostMemfdAddSeals(fd: number, seals: number): void;
  hostFdInfo(fd: number): FdInfo;
  hostReserve(size: bigint, alignment: bigint, hint: bigint): bigint;
  hostFreeAddress(address: bigint, size: bigint): void;
  hostMap(address: bigint, size: bigint, fd: number, offset: bigint): void;
  hostUnmap(address: bigint, size: bigint): void;
  hostProtect(address: bigint, size: bigint, access: number): void;
  /** Copies out on a worker thread, into a new Buffer or into `into`. */
  hostCopyFromAddress(address: bigint, length: number, into?: Buffer): Promise<Buffer>;
  hostCopyToAddress(address: bigint, data: Buffer): Promise<void>;
  /** Copies (target, source, length) triples of mapped memory by pointer on a worker thread, in order. */
  hostCopyPieces(pieces: BigUint64Array): Promise<void>;
  /** Faults every page of mapped memory in, writable, on a worker thread (MADV_POPULATE_WRITE). */
  hostPopulate(address: bigint, size: bigint): Promise<void>;
  hostArrayBuffer(address: bigint, size: number): ArrayBuffer;
  hostDetachArrayBuffer(buffer: ArrayBuffer): void;
  pageSize(): number;
  dup(fd: number): number;
  close(fd: number): void;
  seqpacketListen(path: string, backlog: number): number;
  seqpacketConnect(path: string): number;
  seqpacketAccept(listenFd: number): (Credentials & { fd: number }) | null;
  seqpacketSend(fd: number, data: Buffer, passFd: number): boolean;
  /** Bytes this socket sent that its peer has not read yet (SIOCOUTQ); 0: all read. */
  socketUnsentBytes(fd: number): number;
  seqpacketRecv(fd: number, maxLength: number): Received | null;
  shutdownSocket(fd: number): void;
  peerCredentials(fd: number): Credentials;
  /** RLIMIT_NOFILE, after setting the soft limit to `soft` when given. */
  descriptorLimit(soft?: number): { soft: number; hard: number };
  /** Asks the kernel for `signal` when the process's parent ends (PR_SET_PDEATHSIG). */
  parentDeathSignal(signal: number): void;
  /** One datagram to a Unix socket path ('@name': abstract), as sd_notify sends. */
  unixDgramSend(path: string, data: Buffer): void;
  /** A bound, non-blocking datagram socket (read it with seqpacketRecv). */
  unixDgramBind(path: string): number;
  /** A datagram socket connected to a path ('@name': abstract), to send many notifications on. */
  unixDgramConnect(path: string): number;
  /** One datagram with up to 253 descriptors (SCM_RIGHTS) to a path or on a connected socket, as sd_pid_notify_with_fds sends to NOTIFY_SOCKET. */
  unixDgramSendFds(target: string | number, data: Buffer, fds: number[]): void;
  /** One datagram and every descriptor it carried (close-on-exec); null when nothing waits. */
  unixDgramRecvFds(fd: number, maxLength: number): { data: Buffer; fds: number[]; truncated: boolean } | null;
  /** An empty, growable, owner-only memfd (the parked state's journal). */
  stateMemfdCreate(name: string): number;
  /** Sets or clears FD_CLOEXEC. */
  setCloseOnExec(fd: number, on: boolean): void;
  Poller: new (fd: number, callback: (status: number, events: number) => void) => Poller;
  /** Spin up to this long before each sleep of this thread's event loop, 0: never (native/busy-poll.ts is the policy). */
  busyPoll(microseconds: number): void;
  /** Since load: loop iterations before a sleep, spins begun, spins that met something ready, time spun. */
  busyPollStats(): { prepares: number; spins: number; caught: number; spunMicroseconds: number };
  /** Nanoseconds the calling thread has run on a CPU (CLOCK_THREAD_CPUTIME_ID). */
  threadCpuNanos(): number;
  /**
   * Fault injection (tests): "name:N:ERROR,…" makes the N-th call of an OS or
   * driver function fail once with ERROR; "" turns it off. VMMD_FAULTS sets
   * the same at load. See native/src/faults.h for the names.
   */
  faultsSet(plan: string): void;
  faultsState(): { active: boolean; calls: Record<string, number>; pending: string[] };
  /** Opens libcuda.so.1 once; never throws. */
  cudaLoad(): CudaLoadResult;
  cudaDevices(): CudaDeviceInfo[];
  cudaMemGetInfo(device: number): { free: bigint; total: bigint };
  cudaGranularity(locationType: number, locationId: number, handleTypes: number, recommended: boolean): bigint;
  cudaReserve(size: bigint, alignment: bigint, hint: bigint): bigint;
  cudaFreeAddress(address: bigint, size: bigint): void;
  /** On a driver thread (cuMemCreate is too slow for the event loop); `inline` runs it on the calling thread (the client's own memory). */
  cudaCreate(device: number, locationType: number, locationId: number, size: bigint, handleTypes: number, inline?: boolean): Promise<bigint>;
  cudaRelease(device: number, handle: bigint): Promise<void>;
  /** cuMemCreate and its POSIX-fd export in one job on a driver thread. */
  cudaCreateExported(device: number, locationType: number, locationId: number, size: bigint, handleTypes: number): Promise<{ handle: bigint; fd: number }>;
  /** On a driver thread; with `inline`, on the calling thread (a settled promise). */
  cudaMap(address: bigint, size: bigint, offset: bigint, handle: bigint, inline?: boolean): Promise<void>;
  /**
   * cuMemUnmap on a driver thread; with `synchronize`, cuCtxSynchronize first (as cuMemFree
   * does), for memory this process's own kernels or copies may still be using.
   */
  cudaUnmap(device: number, address: bigint, size: bigint, synchronize?: boolean): Promise<void>;
  /** Several unmaps in one driver-thread job, after one context synchronization when asked: each range's error name, or null. */
  cudaUnmapMany(device: number, addresses: bigint[], sizes: bigint[], synchronize?: boolean): Promise<Array<string | null>>;
  /** cuCtxSynchronize on the device's driver thread: the work queued before now is done when it resolves. */
  cudaSynchronize(device: number): Promise<void>;
  /** On a driver thread; with `inline`, on the calling thread (a settled promise). */
  cudaSetAccess(address: bigint, size: bigint, descriptors: Array<{ type: number; id: number; flags: number }>, inline?: boolean): Promise<void>;
  cudaGetAccess(address: bigint, locationType: number, locationId: number): number;
  cudaExportFd(device: number, handle: bigint): Promise<number>;
  cudaExportFabric(device: number, handle: bigint): Promise<Buffer>;
  /** On a driver thread (with `inline`, on the calling thread); keep fd open until the promise settles. */
  cudaImportFd(fd: number, inline?: boolean): Promise<bigint>;
  cudaImportFabric(fabric: Buffer, inline?: boolean): Promise<bigint>;
  /**
   * Import, map, set access (`flags` 1 read, 3 read-write, to `device` and, when hostNuma >= 0, to that
   * host NUMA node) and release of the imported handle, in one call on the calling thread (a settled
   * promise; native/src/cuda_driver.cc): resolves with undefined, or with the name of the error of the
   * handle's release after a mapping that works; rejects naming the failed step, those before it undone,
   * with stillMapped: true when even undoing the map failed. The caller keeps fd.
   */
  cudaImportMap(fd: number, address: bigint, size: bigint, device: number, flags: 1 | 3, hostNuma: number, peers?: number[]): Promise<string | undefined>;
  /** Whether an imported allocation is exactly `size` bytes (a trial map: the driver maps an allocation only whole). */
  cudaHandleHasSize(device: number, handle: bigint, size: bigint): Promise<boolean>;
  cudaAllocationProperties(handle: bigint): { locationType: number; locationId: number; requestedHandleTypes: number };
  cudaRetainHandle(address: bigint): bigint;
  /** Resolves once the bytes are in device memory (the DMA has landed), not when they are staged. */
  cudaCopyToDevice(device: number, address: bigint, data: Buffer): Promise<void>;
  cudaCopyFromDevice(device: number, address: bigint, length: bigint, into?: Buffer): Promise<Buffer>;
  /**
   * Copies (target, source, length) triples of addresses mapped for the device (device memory, host memory
   * mapped with device access) on `lanes` streams of a driver thread; resolves once every byte has landed.
   */
  cudaCopyPieces(device: number, pieces: BigUint64Array, lanes: number): Promise<void>;
  cudaCanAccessPeer(device: number, peer: number): boolean;
  /** Page-locks client memory; returns its device pointer when mapped, else 0n. */
  cudaHostRegister(device: number, address: bigint, size: bigint, mapped: boolean): bigint;
  cudaHostUnregister(device: number, address: bigint): void;
  /** cuMemHostRegister (portable) on a driver thread: the daemon's staging buffers. */
  cudaPinHost(device: number, address: bigint, size: bigint): Promise<void>;
  /** cuMemHostUnregister on a driver thread. */
  cudaUnpinHost(device: number, address: bigint): Promise<void>;
  /** Legacy cuMemAlloc / cuMemFree: the benchmarks' in-process reference, not used by vmmd. */
  cudaMemAlloc(device: number, size: bigint): bigint;
  cudaMemFree(device: number, pointer: bigint): void;
  hostLock(address: bigint, size: bigint): void;
  hostUnlock(address: bigint, size: bigint): void;
  /** The address of the first byte of an ArrayBuffer or of a view of one. */
  addressOf(memory: ArrayBuffer | ArrayBufferView): bigint;
}

/** The package root: the nearest directory above this file holding package.json. */
function packageRoot(): string {
  let dir = __dirname;
  while (!fs.existsSync(path.join(dir, 'package.json'))) {
    const parent = path.dirname(dir);
    if (parent === dir) return path.resolve(__dirname, '..');
    dir = parent;
  }
  return dir;
}

/**
 * VMMD_ADDON if set; else node-gyp-build's choice: build/Release (compiled
 * here) before prebuilds/<platform>-<arch>/ (shipped in the package, made by
 * prebuildify when it is packed), so installing needs no compiler.
 */
function load(): Addon {
  const root = packageRoot();
  const from = process.env.VMMD_ADDON ?? `${root} (build/Release, then prebuilds/${process.platform}-${process.arch})`;
  try {
    if (process.env.VMMD_ADDON !== undefined) {
      // eslint-disable-next-line @typescript-eslint/no-require-imports
      return require(process.env.VMMD_ADDON) as Addon;
    }
    // eslint-disable-next-line @typescript-eslint/no-require-imports
    return (require('node-gyp-build') as (dir: string) => Addon)(root);
  } catch (cause) {
    const error = new Error(
      `cannot load the vmmd addon from ${from}: ${(cause as Error).message}. ` +
        'Build it on this machine with `npm rebuild vmmd` (`npm run install` in a checkout; needs g++, python3 and the Node headers), ' +
        'or point VMMD_ADDON at a built vmmd_native.node.',
    ) as NativeError;
    error.code = 'ADDON_NOT_LOADED';
    throw error;
  }
}

/** The loaded addon. */
export const addon: Addon = load();

/**
 * True when `error` came from the addon (or mimics it) with the given code.
 * Structural on purpose: errors made by the addon come from the main realm, so
 * `instanceof Error` fails for them inside vm contexts (jest, for one).
 */
export function isNativeError(error: unknown, code?: string): error is NativeError {
  if (typeof error !== 'object' || error === null) return false;
  const found = (error as { code?: unknown }).code;
  return typeof found === 'string' && typeof (error as { message?: unknown }).message === 'string' && (code === undefined || found === code);
}
