/**
 * The VirtualMemory service: the CUDA VMM primitives. Each method checks what
 * only the transport knows (is there a session, which transfer) and leaves
 * every rule of the driver API to the registry.
 */
import * as grpc from '@grpc/grpc-js';
import type { Allocation } from '../../../../generated/vmmd/v1/Allocation';
import type { AllocateAllRequest__Output } from '../../../../generated/vmmd/v1/AllocateAllRequest';
import type { AllocateAllResponse } from '../../../../generated/vmmd/v1/AllocateAllResponse';
import type { CreateRequest__Output } from '../../../../generated/vmmd/v1/CreateRequest';
import type { ExportRequest__Output } from '../../../../generated/vmmd/v1/ExportRequest';
import type { ExportResponse } from '../../../../generated/vmmd/v1/ExportResponse';
import type { FreeAddressRequest__Output } from '../../../../generated/vmmd/v1/FreeAddressRequest';
import type { GetAccessRequest__Output } from '../../../../generated/vmmd/v1/GetAccessRequest';
import type { GetAccessResponse } from '../../../../generated/vmmd/v1/GetAccessResponse';
import type { GetPropertiesRequest__Output } from '../../../../generated/vmmd/v1/GetPropertiesRequest';
import type { ImportRequest__Output } from '../../../../generated/vmmd/v1/ImportRequest';
import type { MapRequest__Output } from '../../../../generated/vmmd/v1/MapRequest';
import type { ReadRequest__Output } from '../../../../generated/vmmd/v1/ReadRequest';
import type { ReadResponse } from '../../../../generated/vmmd/v1/ReadResponse';
import type { ReleaseRequest__Output } from '../../../../generated/vmmd/v1/ReleaseRequest';
import type { ReleaseResponse } from '../../../../generated/vmmd/v1/ReleaseResponse';
import type { Reservation } from '../../../../generated/vmmd/v1/Reservation';
import type { ReserveRequest__Output } from '../../../../generated/vmmd/v1/ReserveRequest';
import type { RetainHandleRequest__Output } from '../../../../generated/vmmd/v1/RetainHandleRequest';
import type { SetAccessRequest__Output } from '../../../../generated/vmmd/v1/SetAccessRequest';
import type { ShareRequest__Output } from '../../../../generated/vmmd/v1/ShareRequest';
import type { ShareResponse } from '../../../../generated/vmmd/v1/ShareResponse';
import type { UnmapRequest__Output } from '../../../../generated/vmmd/v1/UnmapRequest';
import type { UnmapResponse } from '../../../../generated/vmmd/v1/UnmapResponse';
import type { WriteRequest__Output } from '../../../../generated/vmmd/v1/WriteRequest';
import type { WriteResponse } from '../../../../generated/vmmd/v1/WriteResponse';
import type { VmmdProto } from '../../../../common/proto';
import { addon } from '../../../../native';
import type { HandleKind, ImportSource } from '../../../backends/backend';
import { invalidArgument } from '../../../errors';
import type { AllocationRecord, Exported, Registry, ReservationRecord } from '../../../registry';
import type { Session, SessionManager } from '../../session/sessions';
import type { StagingBuffers } from '../../../stores/staging';
import { takeAmountOnce, TransportBudgets } from '../../budgets';
import type { OpenStagingRequest__Output } from '../../../../generated/vmmd/v1/OpenStagingRequest';
import type { StagingBuffer } from '../../../../generated/vmmd/v1/StagingBuffer';
import type { StagedCopy__Output } from '../../../../generated/vmmd/v1/StagedCopy';
import type { StagedCopyResponse } from '../../../../generated/vmmd/v1/StagedCopyResponse';
import { CallContext, clientStream, HandlerDeps, requireSession, serverStream, unary } from './handler';
import { accessGrant, DeviceResolver, handleType, location, toWireAccess, toWireHandleType, toWireLocation, u64 } from '../../wire';

export class VirtualMemoryService {
  private readonly resolveDevice: DeviceResolver;

  constructor(
    private readonly registry: Registry,
    private readonly sessions: SessionManager,
    private readonly staging: StagingBuffers,
    /** Counts each uid's staging buffers' bytes (none: no limit). */
    private readonly budgets?: TransportBudgets,
  ) {
    this.resolveDevice = (uuid, field) => registry.deviceByUuid(uuid, field);
  }

  toWireAllocation(record: AllocationRecord): Allocation {
    const references = this.registry.referenceCount(record);
    return {
      id: String(record.id),
      size: String(record.size),
      location: toWireLocation(record.location),
      device: record.device,
      handleTypes: record.handleTypes.map(toWireHandleType),
      ownerSession: String(record.owner),
      imported: record.imported,
      handleReferences: references,
      mappingCount: record.mappingCount,
      released: references === 0,
    };
  }

  reserve(request: ReserveRequest__Output, context: CallContext): Reservation {
    const record: ReservationRecord = this.registry.reserve(context.caller, {
      size: u64(request.size),
      alignment: u64(request.alignment),
      address: u64(request.address),
    });
    return {
      id: String(record.id),
      address: String(record.address),
      size: String(record.size),
      alignment: String(record.alignment),
      ownerSession: String(record.owner),
    };
  }

  async freeAddress(request: FreeAddressRequest__Output, context: CallContext): Promise<object> {
    await this.registry.freeAddress(context.caller, u64(request.address), u64(request.size));
    return {};
  }

  async create(request: CreateRequest__Output, context: CallContext): Promise<Allocation> {
    const record = await this.registry.create(context.caller, {
      size: u64(request.size),
      location: location(request.location, this.resolveDevice),
      handleType: handleType(request.handleType),
    });
    return this.toWireAllocation(record);
  }

  /** Over gRPC answered once the memory is freed; on the session socket once its free has started (context.socket). */
  async release(request: ReleaseRequest__Output, context: CallContext): Promise<ReleaseResponse> {
    const allocation = u64(request.allocationId);
    if (context.socket === undefined) return this.registry.release(context.caller, allocation);
    const { socket } = context;
    const { result, freeing } = await this.registry.releaseAnswering(context.caller, allocation);
    freeing.catch((error: Error) => socket.freeFailed(allocation, error));
    return result;
  }

  async map(request: MapRequest__Output, context: CallContext): Promise<object> {
    await this.registry.map(context.caller, {
      address: u64(request.address),
      size: u64(request.size),
      offset: u64(request.offset),
      allocationId: u64(request.allocationId),
    });
    return {};
  }

  async unmap(request: UnmapRequest__Output, context: CallContext): Promise<UnmapResponse> {
    return this.registry.unmap(context.caller, u64(request.address), u64(request.size));
  }

  async setAccess(request: SetAccessRequest__Output, context: CallContext): Promise<object> {
    const grants = request.descriptors.map((descriptor, index) => accessGrant(descriptor, index, this.resolveDevice));
    await this.registry.setAccess(context.caller, u64(request.address), u64(request.size), grants);
    return {};
  }

  getAccess(request: GetAccessRequest__Output, context: CallContext): GetAccessResponse {
    return { flags: toWireAccess(this.registry.getAccess(context.caller, u64(request.address), location(request.location, this.resolveDevice))) };
  }

  async export(request: ExportRequest__Output, context: CallContext): Promise<ExportResponse> {
    const kind = handleType(request.handleType);
    // A descriptor needs a session to travel on; fabric bytes travel in the response.
    const session = kind === 'POSIX_FD' ? requireSession(context, 'Export') : undefined;
    session?.checkDescriptorRoom();
    const exported = await this.registry.exportHandle(context.caller, {
      allocationId: u64(request.allocationId),
      handleType: kind,
      shareKey: request.shareKey,
    });
    return this.handOver(session, kind, exported, context);
  }

  /** Create, then Export to the calling session; the allocation is released again if the export fails. */
  async allocate(request: CreateRequest__Output, context: CallContext): Promise<ExportResponse> {
    const session = requireSession(context, 'Allocate');
    session.checkDescriptorRoom();
    const { socket } = context;
    // Sent again after a restart cut off its answer: the allocation the first one made (recorded, then parked,
    // with its request id) is this answer, exported anew, rather than a second allocation.
    const made =
      socket?.again === true ? [...this.registry.allocations.all()].find((one) => one.owner === context.caller && one.request === socket.request) : undefined;
    if (made !== undefined) {
      const again = await this.registry.exportHandle(context.caller, { allocationId: made.id, handleType: 'POSIX_FD', shareKey: '' });
      return this.handOver(session, 'POSIX_FD', again, context);
    }
    const args = {
      size: u64(request.size),
      location: location(request.location, this.resolveDevice),
      handleType: handleType(request.handleType),
      request: socket?.request,
    };
    const exported = await this.registry.createExported(context.caller, args, (cause) => context.log.error({ err: cause }, 'Allocate: the rollback failed'));
    // The client never learns of an allocation whose answer did not reach it: it is released again.
    if (context.socket !== undefined) context.socket.unsent = () => this.registry.release(context.caller, exported.allocation.id);
    return this.handOver(session, 'POSIX_FD', exported, context);
  }

  /**
   * AllocateAll: one allocation per size, made when the device's turn and its
   * memory come (server/registry/referee.ts), each descriptor sent on the
   * session socket; when one cannot be sent, every allocation is released
   * again (descriptors already sent are the client's, closed unclaimed).
   * @throws as Registry.allocateAll; FAILED_PRECONDITION NO_SESSION; RESOURCE_EXHAUSTED BUDGET_EXCEEDED
   *   (the session cannot be sent so many descriptors now); UNAVAILABLE SESSION_SOCKET_FULL
   */
  async allocateAll(request: AllocateAllRequest__Output, context: CallContext): Promise<AllocateAllResponse> {
    const session = requireSession(context, 'AllocateAll');
    session.checkDescriptorRoom(Math.max(1, request.sizes.length));
    const args = {
      sizes: request.sizes.map((size) => u64(size)),
      location: location(request.location, this.resolveDevice),
      handleType: handleType(request.handleType),
      deadlineMs: request.deadlineMs,
      signal: context.signal === undefined ? session.endSignal : AbortSignal.any([session.endSignal, context.signal]),
    };
    const { exported, waitedMs } = await this.registry.allocateAll(context.caller, args);
    const answers: ExportResponse[] = [];
    try {
      for (const one of exported) {
        answers.push(this.handOver(session, 'POSIX_FD', one, context));
        // handOver closed the daemon's copy.
        one.fd = undefined;
      }
    } catch (error) {
      await this.registry.undoAllocateAll(context.caller, exported);
      throw error;
    }
    return { allocations: answers, waitedMs };
  }

  /**
   * Describes an export and hands its descriptor over: attached to the
   * session socket's answer (transfer_id 0), or sent on the session socket as
   * a transfer that the RPC's answer names (closing the daemon's copy).
   */
  private handOver(session: Session | undefined, kind: HandleKind, { allocation, fd, fabric }: Exported, context: CallContext): ExportResponse {
    let transferId = '0';
    if (context.socket !== undefined) context.socket.fd = fd;
    else if (session !== undefined && fd !== undefined) {
      try {
        transferId = session.sendTransfer(fd, { allocation: allocation.id, size: allocation.size });
      } finally {
        // The kernel holds its own reference while the descriptor is in flight.
        addon.close(fd);
      }
    }
    return {
      transferId,
      allocationId: String(allocation.id),
      size: String(allocation.size),
      location: toWireLocation(allocation.location),
      device: allocation.device,
      handleType: toWireHandleType(kind),
      granularity: String(allocation.granularity),
      fabricHandle: fabric ?? Buffer.alloc(0),
      deviceUuid: this.registry.devices[allocation.device]?.uuid ?? '',
    };
  }

  share(request: ShareRequest__Output, context: CallContext): ShareResponse {
    return { shareKey: this.registry.share(context.caller, u64(request.allocationId)) };
  }

  async import(request: ImportRequest__Output, context: CallContext): Promise<Allocation> {
    const kind = handleType(request.handleType);
    this.registry.deviceTable.checkIndex(request.device);
    const size = u64(request.size);
    let source: ImportSource;
    if (kind === 'FABRIC') {
      if (request.fabricHandle.length !== 64) {
        throw invalidArgument('BAD_DESCRIPTOR', `fabric_handle must be the 64 bytes Export returned, not ${request.fabricHandle.length}`);
      }
      source = { fabric: request.fabricHandle };
    } else {
      const session = requireSession(context, 'Import');
      if (u64(request.transferId) === 0n) throw invalidArgument('BAD_TRANSFER', 'transfer_id must be set (ids start at 1)');
      source = { fd: await this.sessions.takeTransfer(session, String(u64(request.transferId))) };
    }
    return this.toWireAllocation(await this.registry.importHandle(context.caller, source, size));
  }

  getProperties(request: GetPropertiesRequest__Output, context: CallContext): Allocation {
    return this.toWireAllocation(this.registry.inspectAllocation(context.caller, u64(request.allocationId)));
  }

  async retainHandle(request: RetainHandleRequest__Output, context: CallContext): Promise<Allocation> {
    return this.toWireAllocation(await this.registry.retainHandle(context.caller, u64(request.address)));
  }

  async *read(request: ReadRequest__Output, context: CallContext): AsyncGenerator<ReadResponse> {
    for await (const chunk of this.registry.read(context.caller, u64(request.address), u64(request.length))) {
      yield { offset: String(chunk.offset), data: chunk.data };
    }
  }

  async write(requests: AsyncIterable<WriteRequest__Output>, context: CallContext): Promise<WriteResponse> {
    let address: bigint | undefined;
    let written = 0n;
    for await (const request of requests) {
      address ??= u64(request.address);
      if (request.data.length === 0) continue;
      await this.registry.write(context.caller, address + written, request.data);
      written += BigInt(request.data.length);
    }
    if (written === 0n) throw invalidArgument('ZERO_SIZE', 'Write received no bytes');
    return { bytesWritten: String(written) };
  }

  async openStaging(request: OpenStagingRequest__Output, context: CallContext): Promise<StagingBuffer> {
    const session = requireSession(context, 'OpenStaging');
    if (u64(request.transferId) === 0n) throw invalidArgument('BAD_TRANSFER', 'transfer_id must be set (ids start at 1)');
    const fd = await this.sessions.takeTransfer(session, String(u64(request.transferId)));
    const budget = this.budgets?.stagingBytes;
    const charge = budget === undefined ? undefined : (size: bigint) => takeAmountOnce(budget, session.peer.uid, Number(size));
    return { size: String(await this.staging.open(session.id, fd, charge)) };
  }

  async readStaged(request: StagedCopy__Output, context: CallContext): Promise<StagedCopyResponse> {
    const session = requireSession(context, 'ReadStaged');
    const length = u64(request.length);
    await this.staging.use(session.id, u64(request.stagingOffset), length, (view) => this.registry.readInto(context.caller, u64(request.address), view));
    return { bytes: String(length) };
  }

  async writeStaged(request: StagedCopy__Output, context: CallContext): Promise<StagedCopyResponse> {
    const session = requireSession(context, 'WriteStaged');
    const length = u64(request.length);
    await this.staging.use(session.id, u64(request.stagingOffset), length, (view) => this.registry.write(context.caller, u64(request.address), view));
    return { bytes: String(length) };
  }

  addToServer(server: grpc.Server, proto: VmmdProto, deps: HandlerDeps): void {
    server.addService(proto.vmmd.v1.VirtualMemory.service, {
      // What Reserve, Create, Map and Import made is undone when their answer can reach nobody (handler.ts).
      Reserve: unary(
        deps,
        'Reserve',
        (r: ReserveRequest__Output, c) => this.reserve(r, c),
        (made, c) => this.registry.freeAddress(c.caller, BigInt(String(made.address)), BigInt(String(made.size))),
      ),
      FreeAddress: unary(deps, 'FreeAddress', (r: FreeAddressRequest__Output, c) => this.freeAddress(r, c)),
      Create: unary(
        deps,
        'Create',
        (r: CreateRequest__Output, c) => this.create(r, c),
        (made, c) => this.registry.release(c.caller, BigInt(String(made.id))),
      ),
      Release: unary(deps, 'Release', (r: ReleaseRequest__Output, c) => this.release(r, c)),
      Map: unary(
        deps,
        'Map',
        (r: MapRequest__Output, c) => this.map(r, c),
        (_made, c, r) => this.registry.unmap(c.caller, u64(r.address), u64(r.size)),
      ),
      Unmap: unary(deps, 'Unmap', (r: UnmapRequest__Output, c) => this.unmap(r, c)),
      SetAccess: unary(deps, 'SetAccess', (r: SetAccessRequest__Output, c) => this.setAccess(r, c)),
      GetAccess: unary(deps, 'GetAccess', (r: GetAccessRequest__Output, c) => this.getAccess(r, c)),
      Export: unary(deps, 'Export', (r: ExportRequest__Output, c) => this.export(r, c)),
      Allocate: unary(deps, 'Allocate', (r: CreateRequest__Output, c) => this.allocate(r, c)),
      AllocateAll: unary(deps, 'AllocateAll', (r: AllocateAllRequest__Output, c) => this.allocateAll(r, c)),
      Share: unary(deps, 'Share', (r: ShareRequest__Output, c) => this.share(r, c)),
      Import: unary(
        deps,
        'Import',
        (r: ImportRequest__Output, c) => this.import(r, c),
        (made, c) => this.registry.release(c.caller, BigInt(String(made.id))),
      ),
      GetProperties: unary(deps, 'GetProperties', (r: GetPropertiesRequest__Output, c) => this.getProperties(r, c)),
      RetainHandle: unary(deps, 'RetainHandle', (r: RetainHandleRequest__Output, c) => this.retainHandle(r, c)),
      Read: serverStream(deps, 'Read', (r: ReadRequest__Output, c) => this.read(r, c)),
      OpenStaging: unary(deps, 'OpenStaging', (r: OpenStagingRequest__Output, c) => this.openStaging(r, c)),
      ReadStaged: unary(deps, 'ReadStaged', (r: StagedCopy__Output, c) => this.readStaged(r, c)),
      WriteStaged: unary(deps, 'WriteStaged', (r: StagedCopy__Output, c) => this.writeStaged(r, c)),
      Write: clientStream(deps, 'Write', (requests: AsyncIterable<WriteRequest__Output>, c) => this.write(requests, c)),
    });
  }
}
