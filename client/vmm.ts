/**
 * Remote virtual memory: one promise method per VirtualMemory RPC, and the
 * local half of sharing: import() maps an exported allocation into this
 * process, importDescriptor() hands one of this process's descriptors to the
 * daemon.
 */
import { traceMark } from '../common/trace';
import type { Allocation__Output } from '../generated/vmmd/v1/Allocation';
import type { AllocateAllRequest } from '../generated/vmmd/v1/AllocateAllRequest';
import type { AllocateAllResponse__Output } from '../generated/vmmd/v1/AllocateAllResponse';
import type { CreateRequest } from '../generated/vmmd/v1/CreateRequest';
import type { ExportRequest } from '../generated/vmmd/v1/ExportRequest';
import type { ExportResponse__Output } from '../generated/vmmd/v1/ExportResponse';
import type { FreeAddressRequest } from '../generated/vmmd/v1/FreeAddressRequest';
import type { GetAccessRequest } from '../generated/vmmd/v1/GetAccessRequest';
import type { GetAccessResponse__Output } from '../generated/vmmd/v1/GetAccessResponse';
import type { GetPropertiesRequest } from '../generated/vmmd/v1/GetPropertiesRequest';
import type { ImportRequest } from '../generated/vmmd/v1/ImportRequest';
import type { MapRequest } from '../generated/vmmd/v1/MapRequest';
import type { ReleaseRequest } from '../generated/vmmd/v1/ReleaseRequest';
import type { ReleaseResponse__Output } from '../generated/vmmd/v1/ReleaseResponse';
import type { Reservation__Output } from '../generated/vmmd/v1/Reservation';
import type { ReserveRequest } from '../generated/vmmd/v1/ReserveRequest';
import type { RetainHandleRequest } from '../generated/vmmd/v1/RetainHandleRequest';
import type { SetAccessRequest } from '../generated/vmmd/v1/SetAccessRequest';
import type { ShareRequest } from '../generated/vmmd/v1/ShareRequest';
import type { ShareResponse__Output } from '../generated/vmmd/v1/ShareResponse';
import type { UnmapRequest } from '../generated/vmmd/v1/UnmapRequest';
import type { UnmapResponse__Output } from '../generated/vmmd/v1/UnmapResponse';
import type { VirtualMemoryClient } from '../generated/vmmd/v1/VirtualMemory';
import type { ReadResponse__Output } from '../generated/vmmd/v1/ReadResponse';
import type { WriteResponse__Output } from '../generated/vmmd/v1/WriteResponse';
import { native } from '../native/client';
import { VmmdError } from './errors';
import { CudaImportedMemory, HostImportedMemory, ImportedMemory, mapFabricHandle } from './local-memory';
import { CallSettings, collectStream, Input, toWire, unaryCall, writeChunks } from './rpc';
import type { ClientSession } from './session';
import { DEFAULT_STAGING_BYTES, STAGED_MIN_BYTES, StagingBuffer, StagingRefused } from './staging';

export interface ImportOptions {
  /** Needed for another session's allocation: the key its owner got from share(). */
  shareKey?: string;
  /** Map without write access. */
  readOnly?: boolean;
  /** Take the allocation as fabric bytes rather than a descriptor (cuda, where fabric is usable). */
  fabric?: boolean;
  /** cuda, host-located (HOST_NUMA) memory: give the CPU access too, and a `buffer` view. */
  hostAccess?: boolean;
}

/**
 * This process's index of the daemon's device: the same UUID where this
 * process sees it (CUDA_VISIBLE_DEVICES may order devices differently), else
 * the daemon's index.
 */
function localDevice(daemonIndex: number, uuid: string): number {
  if (uuid === '' || !native.cudaLoad().loaded) return daemonIndex;
  // A process's devices do not change: asked of the driver once (a dozen calls per device).
  localDevices ??= new Map(native.cudaDevices().map((device) => [device.uuid, device.index]));
  return localDevices.get(uuid) ?? daemonIndex;
}

let localDevices: Map<string, number> | undefined;

/** What mapping an exported allocation needs to know of it. */
type Exported = Pick<ExportResponse__Output, 'allocationId' | 'size' | 'granularity' | 'device' | 'deviceUuid'> & {
  location?: { type: string; id: number } | null;
};

export class VirtualMemoryApi {
  // Large reads and writes go through it (undefined: stream everything over gRPC).
  private readonly staging?: StagingBuffer;

  constructor(
    private readonly client: VirtualMemoryClient,
    private readonly settings: CallSettings,
    private readonly session: ClientSession,
    private readonly backend: string,
    stagingBytes = DEFAULT_STAGING_BYTES,
  ) {
    if (stagingBytes > 0) {
      this.staging = new StagingBuffer(stagingBytes, {
        open: async (fd) => {
          await unaryCall(this.client, this.client.OpenStaging, { transferId: this.session.sendDescriptor(fd) }, this.settings);
        },
        read: (address, length, offset) => unaryCall(this.client, this.client.ReadStaged, { address, length, stagingOffset: offset }, this.settings),
        write: (address, length, offset) => unaryCall(this.client, this.client.WriteStaged, { address, length, stagingOffset: offset }, this.settings),
      });
    }
  }

  /** @throws VmmdError INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, BAD_ALIGNMENT */
  reserve(request: Input<ReserveRequest>): Promise<Reservation__Output> {
    return unaryCall(this.client, this.client.Reserve, request, this.settings);
  }

  /** @throws VmmdError NOT_FOUND NOT_RESERVED, INVALID_ARGUMENT PARTIAL_FREE, FAILED_PRECONDITION RESERVATION_MAPPED */
  freeAddress(request: Input<FreeAddressRequest>): Promise<object> {
    return unaryCall(this.client, this.client.FreeAddress, request, this.settings);
  }

  /** @throws VmmdError INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED; RESOURCE_EXHAUSTED OUT_OF_MEMORY; OUT_OF_RANGE UNKNOWN_DEVICE */
  create(request: Input<CreateRequest>): Promise<Allocation__Output> {
    return unaryCall(this.client, this.client.Create, request, this.settings);
  }

  /**
   * Drops this session's reference to an allocation: on the session socket
   * (one round trip), or the Release RPC where the socket is gone.
   * @throws VmmdError NOT_FOUND UNKNOWN_ALLOCATION, FAILED_PRECONDITION ALREADY_RELEASED, PERMISSION_DENIED NOT_OWNER
   */
  async release(request: Input<ReleaseRequest>): Promise<ReleaseResponse__Output> {
    if (this.session.closed) return unaryCall(this.client, this.client.Release, request, this.settings);
    const { freed, handleReferences, mappingCount } = await this.session.release(String(request.allocationId ?? 0));
    return { freed, handleReferences, mappingCount };
  }

  /** @throws VmmdError ALREADY_MAPPED, NOT_ALIGNED, NONZERO_OFFSET, BEYOND_ALLOCATION, BEYOND_RESERVATION */
  map(request: Input<MapRequest>): Promise<object> {
    return unaryCall(this.client, this.client.Map, request, this.settings);
  }

  /** @throws VmmdError NOT_FOUND NOT_MAPPED, INVALID_ARGUMENT PARTIAL_UNMAP */
  unmap(request: Input<UnmapRequest>): Promise<UnmapResponse__Output> {
    return unaryCall(this.client, this.client.Unmap, request, this.settings);
  }

  /** @throws VmmdError FAILED_PRECONDITION NOT_FULLY_MAPPED, INVALID_ARGUMENT PARTIAL_MAPPING */
  setAccess(request: Input<SetAccessRequest>): Promise<object> {
    return unaryCall(this.client, this.client.SetAccess, request, this.settings);
  }

  /** @throws VmmdError NOT_FOUND NOT_MAPPED */
  getAccess(request: Input<GetAccessRequest>): Promise<GetAccessResponse__Output> {
    return unaryCall(this.client, this.client.GetAccess, request, this.settings);
  }

  /** The raw Export call; import() is what maps the descriptor. @throws VmmdError NOT_OWNER, NO_SESSION */
  export(request: Input<ExportRequest>): Promise<ExportResponse__Output> {
    return unaryCall(this.client, this.client.Export, request, this.settings);
  }

  /**
   * A key that lets another session import the allocation: on the session socket, or the Share RPC where the socket is gone.
   * @throws VmmdError PERMISSION_DENIED NOT_OWNER, NOT_FOUND UNKNOWN_ALLOCATION
   */
  async share(request: Input<ShareRequest>): Promise<ShareResponse__Output> {
    if (this.session.closed) return unaryCall(this.client, this.client.Share, request, this.settings);
    return { shareKey: await this.session.share(String(request.allocationId ?? 0)) };
  }

  /** The raw Import call; importDescriptor() sends the descriptor first. */
  importTransfer(request: Input<ImportRequest>): Promise<Allocation__Output> {
    return unaryCall(this.client, this.client.Import, request, this.settings);
  }

  /** @throws VmmdError NOT_FOUND UNKNOWN_ALLOCATION */
  getProperties(request: Input<GetPropertiesRequest>): Promise<Allocation__Output> {
    return unaryCall(this.client, this.client.GetProperties, request, this.settings);
  }

  /** @throws VmmdError NOT_FOUND NOT_MAPPED */
  retainHandle(request: Input<RetainHandleRequest>): Promise<Allocation__Output> {
    return unaryCall(this.client, this.client.RetainHandle, request, this.settings);
  }

  /**
   * Exports an allocation and maps it into this process: shared pages on the
   * host backend, a device pointer in this process's CUDA context on cuda.
   * With `fabric`, the allocation travels as fabric bytes instead of a descriptor.
   * @throws VmmdError from Export, TRANSFER_NOT_RECEIVED, NO_CUDA, LOCAL_MAP_FAILED
   */
  async import(allocationId: bigint | string, options: ImportOptions = {}): Promise<ImportedMemory> {
    const readOnly = options.readOnly ?? false;
    if (!options.fabric && !this.session.closed) {
      // The session socket: the descriptor comes with the answer, one round trip.
      const { message, fd } = await this.session.export(String(allocationId), options.shareKey ?? '');
      return this.mapDescriptor(message, fd, readOnly, options.hostAccess ?? false);
    }
    const exported = await this.export({
      allocationId,
      shareKey: options.shareKey ?? '',
      handleType: options.fabric ? 'HANDLE_TYPE_FABRIC' : 'HANDLE_TYPE_POSIX_FD',
    });
    if (options.fabric) {
      const device = localDevice(exported.device, exported.deviceUuid);
      return mapFabricHandle(exported.fabricHandle, BigInt(exported.size), BigInt(exported.granularity), device, {
        allocationId: BigInt(exported.allocationId),
        readOnly,
      });
    }
    return this.mapExported(exported, readOnly, options.hostAccess ?? false);
  }

  /**
   * A new allocation, owned by this session and mapped into this process, in
   * one round trip (the Allocate RPC: create and export). close() unmaps it
   * here; release() through the daemon frees it.
   * @throws VmmdError from Create (OUT_OF_MEMORY, NOT_ALIGNED…), TRANSFER_NOT_RECEIVED, NO_CUDA, LOCAL_MAP_FAILED
   */
  async allocate(request: Input<CreateRequest>, options: { hostAccess?: boolean } = {}): Promise<ImportedMemory> {
    // The session socket for a descriptor (the default handle type); fabric handles through the RPC.
    if ((request.handleType === undefined || request.handleType === 'HANDLE_TYPE_POSIX_FD') && request.size !== undefined) {
      return this.mapAllocated(
        await this.session.allocate(BigInt(request.size as bigint | string | number), request.location as CreateRequest['location']),
        options.hostAccess ?? false,
      );
    }
    const response = await this.allocateRaw(request);
    const fd = await this.session.takeTransfer(response.transferId);
    try {
      return await this.mapDescriptor(response, fd, false, options.hostAccess ?? false);
    } catch (error) {
      await this.release({ allocationId: response.allocationId }).catch(() => undefined);
      throw error;
    }
  }

  /**
   * A new allocation of this session's on the session socket, not mapped: the answer and its descriptor (the
   * caller owns it; mapAllocated() maps it). For an allocation asked for ahead of need (`awaited` false).
   * @throws VmmdError as the Allocate RPC, SESSION_LOST
   */
  allocateUnmapped(size: bigint, location: Input<CreateRequest>['location'], awaited = true): Promise<{ message: ExportResponse__Output; fd: number }> {
    return this.session.allocate(size, location as CreateRequest['location'], undefined, awaited);
  }

  /**
   * Maps an allocation allocateUnmapped() received (taking over its descriptor).
   * @throws VmmdError NO_CUDA, LOCAL_MAP_FAILED: the allocation is then released
   */
  async mapAllocated(allocated: { message: ExportResponse__Output; fd: number }, hostAccess = false): Promise<ImportedMemory> {
    const exported = allocated.message;
    try {
      return await this.mapDescriptor(exported, allocated.fd, false, hostAccess);
    } catch (error) {
      await this.release({ allocationId: exported.allocationId }).catch(() => undefined);
      throw error;
    }
  }

  /** The raw Allocate call: the descriptor waits on the session socket under the returned transfer id. */
  allocateRaw(request: Input<CreateRequest>): Promise<ExportResponse__Output> {
    return unaryCall(this.client, this.client.Allocate, request, this.settings);
  }

  /**
   * The raw AllocateAll call: one allocation per size, all or none, served in
   * the device's turn once the memory is free (waiting up to `deadlineMs`);
   * each descriptor waits on the session socket under its transfer id.
   * The call's own deadline is stretched to cover the wait.
   * @throws VmmdError RESOURCE_EXHAUSTED OUT_OF_MEMORY (not freed in time: nothing was made), BUDGET_EXCEEDED;
   *   OUT_OF_RANGE TOO_MANY_SIZES, BEYOND_DEVICE, BAD_DEADLINE, UNKNOWN_DEVICE; INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED
   */
  allocateAllRaw(request: Input<AllocateAllRequest>): Promise<AllocateAllResponse__Output> {
    const waitMs = Number(request.deadlineMs ?? 0);
    const settings = { ...this.settings, deadlineMs: this.settings.deadlineMs + (Number.isFinite(waitMs) && waitMs > 0 ? waitMs : 0) };
    return unaryCall(this.client, this.client.AllocateAll, request, settings);
  }

  /**
   * AllocateAll, each allocation mapped into this process (in the order of
   * `sizes`). When one cannot be claimed or mapped, every one is released
   * again: the caller gets all of them or none.
   * @throws VmmdError as allocateAllRaw; TRANSFER_NOT_RECEIVED, NO_CUDA, LOCAL_MAP_FAILED
   */
  async allocateAll(request: Input<AllocateAllRequest>, options: { hostAccess?: boolean } = {}): Promise<{ memory: ImportedMemory[]; waitedMs: number }> {
    const response = await this.allocateAllRaw(request);
    const memory: ImportedMemory[] = [];
    try {
      for (const exported of response.allocations) memory.push(await this.mapExported(exported, false, options.hostAccess ?? false));
    } catch (error) {
      await Promise.all(memory.map((mapped) => mapped.close().catch(() => undefined)));
      // Descriptors not yet claimed are closed unclaimed by the session's inbox.
      await Promise.all(response.allocations.map((exported) => this.release({ allocationId: exported.allocationId }).catch(() => undefined)));
      throw error;
    }
    return { memory, waitedMs: response.waitedMs };
  }

  /** Claims an exported descriptor from the session socket and maps it here. */
  private async mapExported(exported: ExportResponse__Output, readOnly: boolean, hostAccess: boolean): Promise<ImportedMemory> {
    return this.mapDescriptor(exported, await this.session.takeTransfer(exported.transferId), readOnly, hostAccess);
  }

  /** Maps a descriptor of an exported allocation here (taking it over). */
  private async mapDescriptor(exported: Exported, fd: number, readOnly: boolean, hostAccess: boolean): Promise<ImportedMemory> {
    traceMark('mark:client maps');
    const id = BigInt(exported.allocationId);
    const size = BigInt(exported.size);
    const granularity = BigInt(exported.granularity);
    if (this.backend === 'cuda') {
      const hostNuma = hostAccess && exported.location?.type === 'LOCATION_TYPE_HOST_NUMA' ? exported.location.id : undefined;
      const device = localDevice(exported.device, exported.deviceUuid);
      return CudaImportedMemory.map(id, { fd }, size, granularity, device, readOnly, hostNuma);
    }
    return HostImportedMemory.map(id, fd, size, granularity, readOnly);
  }

  /**
   * Sends a descriptor of this process to the daemon and makes an allocation
   * of it, owned by this session. The caller keeps (and closes) its own fd.
   * @throws VmmdError INVALID_ARGUMENT BAD_DESCRIPTOR, SESSION_LOST
   */
  importDescriptor(fd: number, options: { size?: bigint; device?: number } = {}): Promise<Allocation__Output> {
    const transferId = this.session.sendDescriptor(fd);
    return this.importTransfer({ transferId, device: options.device ?? 0, size: options.size ?? 0n });
  }

  /**
   * Reads bytes at a mapped address the daemon may read: through the staging
   * buffer from STAGED_MIN_BYTES up, else (or when the daemon refuses the
   * buffer for its staging budget) streamed over gRPC.
   * @throws VmmdError NOT_MAPPED, NO_ACCESS, NOT_FULLY_MAPPED
   */
  async read(address: bigint | string, length: bigint | number): Promise<Buffer> {
    if (this.stages(Number(length))) {
      const staged = await unlessRefused(() => this.staging!.read(BigInt(address), Number(length)));
      if (staged !== undefined) return staged;
    }
    const call = this.client.Read(toWire({ address, length }) as never, this.settings.metadata(), {
      deadline: Date.now() + this.settings.deadlineMs,
    });
    return collectStream(call as AsyncIterable<ReadResponse__Output>);
  }

  /**
   * As read(), into `into` (its whole length): no new buffer, for callers that read repeatedly.
   * @returns `into`, as a Buffer
   */
  async readInto(address: bigint | string, into: Uint8Array): Promise<Buffer> {
    const target = Buffer.from(into.buffer, into.byteOffset, into.byteLength);
    if (this.stages(into.byteLength)) {
      const staged = await unlessRefused(() => this.staging!.read(BigInt(address), into.byteLength, target));
      if (staged !== undefined) return staged;
    }
    (await this.read(address, into.byteLength)).copy(target);
    return target;
  }

  /**
   * Writes bytes to a mapped address the daemon may write: through the
   * staging buffer from STAGED_MIN_BYTES up, else (or when the daemon refuses
   * the buffer for its staging budget) streamed over gRPC.
   * @throws VmmdError NOT_MAPPED, NO_ACCESS, NOT_FULLY_MAPPED
   */
  async write(address: bigint | string, data: Uint8Array): Promise<WriteResponse__Output> {
    if (this.stages(data.byteLength)) {
      const staged = await unlessRefused(() => this.staging!.write(BigInt(address), data).then(() => true));
      if (staged !== undefined) return { bytesWritten: String(data.byteLength) };
    }
    return new Promise((resolve, reject) => {
      const call = this.client.Write(this.settings.metadata(), { deadline: Date.now() + this.settings.deadlineMs }, (error, response) => {
        if (error) reject(VmmdError.fromServiceError(error));
        else resolve(response as WriteResponse__Output);
      });
      writeChunks(call, data, (offset, chunk) => ({ address: offset === 0 ? String(address) : '0', data: chunk }));
    });
  }

  /** Unmaps the staging buffer here (the session's end unmaps the daemon's side). */
  closeStaging(): void {
    this.staging?.close();
  }

  /** Whether a copy of `length` bytes goes through the staging buffer (not once the daemon refused it). */
  private stages(length: number): boolean {
    return this.staging !== undefined && !this.staging.refused && length >= STAGED_MIN_BYTES && !this.session.closed;
  }
}

/** A staged copy's result, or undefined where the daemon refused the buffer (nothing was copied: the caller streams). */
async function unlessRefused<T>(copy: () => Promise<T>): Promise<T | undefined> {
  try {
    return await copy();
  } catch (error) {
    if (error instanceof StagingRefused) return undefined;
    throw error;
  }
}
