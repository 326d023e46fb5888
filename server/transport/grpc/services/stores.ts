/** The Stores service: shared memory with Legate's attach/detach semantics, and the data path. */
import * as grpc from '@grpc/grpc-js';
import type { AttachRequest__Output } from '../../../../generated/vmmd/v1/AttachRequest';
import type { CloseRequest__Output } from '../../../../generated/vmmd/v1/CloseRequest';
import type { CloseResponse } from '../../../../generated/vmmd/v1/CloseResponse';
import type { CopyRequest__Output } from '../../../../generated/vmmd/v1/CopyRequest';
import type { CreateStoreRequest__Output } from '../../../../generated/vmmd/v1/CreateStoreRequest';
import type { DataChunk } from '../../../../generated/vmmd/v1/DataChunk';
import type { DataReadRequest__Output } from '../../../../generated/vmmd/v1/DataReadRequest';
import type { DataWriteRequest__Output } from '../../../../generated/vmmd/v1/DataWriteRequest';
import type { DataWriteResponse } from '../../../../generated/vmmd/v1/DataWriteResponse';
import type { DetachRequest__Output } from '../../../../generated/vmmd/v1/DetachRequest';
import type { FillRequest__Output } from '../../../../generated/vmmd/v1/FillRequest';
import type { ListStoresResponse } from '../../../../generated/vmmd/v1/ListStoresResponse';
import type { OpenRequest__Output } from '../../../../generated/vmmd/v1/OpenRequest';
import type { OpenResponse } from '../../../../generated/vmmd/v1/OpenResponse';
import type { Span__Output } from '../../../../generated/vmmd/v1/Span';
import type { Store } from '../../../../generated/vmmd/v1/Store';
import type { StoreEvent as WireStoreEvent } from '../../../../generated/vmmd/v1/StoreEvent';
import type { WatchRequest__Output } from '../../../../generated/vmmd/v1/WatchRequest';
import type { VmmdProto } from '../../../../common/proto';
import { addon } from '../../../../native';
import { invalidArgument, permissionDenied, resourceExhausted } from '../../../errors';
import { DAEMON_OWNER, IO_CHUNK_BYTES, Registry } from '../../../registry';
import type { SessionManager } from '../../session/sessions';
import { StoreEvent, StoreRecord, StoreRegistry, StoreTarget } from '../../../stores/stores';
import { CallContext, clientStream, HandlerDeps, requireSession, serverStream, unary } from './handler';
import { toWireStore, u64 } from '../../wire';
import { checkWriter, openFor } from '../../../stores/store-writers';

const TARGETS: Record<string, StoreTarget | undefined> = {
  STORE_TARGET_UNSPECIFIED: 'SYSMEM',
  STORE_TARGET_SYSMEM: 'SYSMEM',
  STORE_TARGET_ZCMEM: 'ZCMEM',
  STORE_TARGET_FBMEM: 'FBMEM',
};

const CHUNK = BigInt(IO_CHUNK_BYTES);

/** Events a watcher's reader may fall behind by before it is dropped (FELL_BEHIND). */
export const WATCH_QUEUE_EVENTS = 1024;

/** One end of a data operation: a store range, or daemon-mapped memory at an address. */
type Place = { store: StoreRecord; offset: bigint } | { address: bigint };

export class StoresService {
  constructor(
    private readonly registry: Registry,
    private readonly stores: StoreRegistry,
    private readonly sessions: SessionManager,
  ) {}

  toWire(store: StoreRecord): Store {
    return toWireStore(store) as Store;
  }

  async createStore(request: CreateStoreRequest__Output, context: CallContext): Promise<Store> {
    const store = await this.stores.create(context.caller, {
      allocationId: u64(request.allocationId),
      name: request.name,
      readOnly: request.readOnly,
      handOver: request.handOver,
      size: u64(request.size),
      creatorUid: context.who?.peer?.uid,
    });
    return this.toWire(store);
  }

  async attach(request: AttachRequest__Output, context: CallContext): Promise<Store> {
    const session = requireSession(context, 'Attach');
    const target = TARGETS[String(request.target)];
    if (target === undefined) throw invalidArgument('BAD_ENUM', `target ${JSON.stringify(request.target)} is not a StoreTarget`);
    if (u64(request.transferId) === 0n) throw invalidArgument('BAD_TRANSFER', 'transfer_id must be set (ids start at 1)');
    const fd = await this.sessions.takeTransfer(session, String(u64(request.transferId)));
    const store = await this.stores.attach(context.caller, fd, {
      target,
      device: request.device,
      size: u64(request.size),
      readOnly: request.readOnly,
      name: request.name,
      hasDeleter: request.hasDeleter,
      creatorUid: session.peer.uid,
    });
    return this.toWire(store);
  }

  /** @throws PERMISSION_DENIED NOT_STORE_WRITER (asked writable by a uid that is not the store's writer) */
  async open(request: OpenRequest__Output, context: CallContext): Promise<OpenResponse> {
    const session = requireSession(context, 'Open');
    session.checkDescriptorRoom();
    const store = this.stores.findRef(request.store);
    const { fd, descriptorReadOnly } = await openFor(this.stores, context.caller, store, request.writable, context.who);
    let transferId = '0';
    if (context.socket !== undefined) {
      // The descriptor rides the answer; an open whose answer cannot be sent is dropped again.
      context.socket.fd = fd;
      context.socket.unsent = () => this.stores.close(context.caller, store);
    } else {
      try {
        transferId = session.sendTransfer(fd, { allocation: store.memory.allocationId, size: store.size });
      } catch (error) {
        await this.stores.close(context.caller, store);
        throw error;
      } finally {
        addon.close(fd);
      }
    }
    return {
      store: this.toWire(store),
      transferId,
      granularity: String(store.memory.granularity),
      mappedSize: String(store.memory.mappedSize),
      descriptorReadOnly,
    };
  }

  /** @throws PERMISSION_DENIED NOT_STORE_WRITER (server/stores/store-writers.ts) */
  private checkWriter(store: StoreRecord, context: CallContext): void {
    checkWriter(store, context.who);
  }

  async close(request: CloseRequest__Output, context: CallContext): Promise<CloseResponse> {
    const store = this.stores.find({ id: u64(request.storeId), name: '' });
    return { opens: await this.stores.close(context.caller, store) };
  }

  /** @throws PERMISSION_DENIED NOT_OWNER (another session's store; a daemon-owned store another uid made, unless the caller is an admin) */
  private async undoStore(made: Store, context: CallContext): Promise<void> {
    await this.stores.detach(context.caller, this.stores.find({ id: BigInt(String(made.id)), name: '' }));
  }

  async detach(request: DetachRequest__Output, context: CallContext): Promise<Store> {
    const store = this.stores.findRef(request.store);
    const who = context.who;
    if (store.owner === DAEMON_OWNER && who?.peer !== undefined && !who.admin && store.creatorUid !== who.peer.uid) {
      throw permissionDenied(
        'NOT_OWNER',
        `store ${store.id} was handed to the daemon by ${store.creatorUid === undefined ? 'an admin' : `uid ${store.creatorUid}`}; only that uid or an admin detaches it`,
      );
    }
    return this.toWire(await this.stores.detach(context.caller, store));
  }

  list(): ListStoresResponse {
    return { stores: this.stores.list().map((store) => this.toWire(store)) };
  }

  private eventToWire(event: StoreEvent): WireStoreEvent {
    return { sequence: String(event.sequence), kind: `KIND_${event.kind}`, store: this.toWire(event.store), session: String(event.session) };
  }

  /**
   * Store events from `since` on, then as they happen. A watcher whose reader
   * falls more than WATCH_QUEUE_EVENTS behind is dropped: its queue is freed at
   * once, and what it already has is followed by RESOURCE_EXHAUSTED FELL_BEHIND.
   * Ends once `signal` aborts (its client cancelled), without waiting for another event.
   * @throws RESOURCE_EXHAUSTED FELL_BEHIND saying by how many events, and the since to watch again from
   */
  async *watch(request: WatchRequest__Output, signal?: AbortSignal): AsyncGenerator<WireStoreEvent> {
    // Invariant: at most WATCH_QUEUE_EVENTS events wait here; once over, none do and the watcher is unsubscribed.
    const queue: StoreEvent[] = [];
    let fellBehind = false;
    let wake: (() => void) | undefined;
    const onEvent = (event: StoreEvent) => {
      if (queue.length >= WATCH_QUEUE_EVENTS) {
        fellBehind = true;
        queue.length = 0;
        this.stores.off('event', onEvent);
      } else {
        queue.push(event);
      }
      wake?.();
    };
    const onAbort = () => wake?.();
    // Subscribe before replaying, and skip what the replay already gave: no event is lost or doubled.
    this.stores.on('event', onEvent);
    signal?.addEventListener('abort', onAbort);
    try {
      let last = u64(request.since);
      for (const event of this.stores.eventsSince(last)) {
        if (fellBehind) break;
        last = event.sequence;
        yield this.eventToWire(event);
      }
      for (;;) {
        while (queue.length > 0) {
          const event = queue.shift()!;
          if (event.sequence <= last) continue;
          last = event.sequence;
          yield this.eventToWire(event);
        }
        if (fellBehind) {
          throw resourceExhausted(
            'FELL_BEHIND',
            `this watcher fell behind by ${this.stores.lastSequence - last} events (more than ${WATCH_QUEUE_EVENTS} waited for its reader) and is dropped; watch again with since=${last}`,
          );
        }
        if (signal?.aborted) return;
        await new Promise<void>((resolve) => (wake = resolve));
        wake = undefined;
        if (signal?.aborted) return;
      }
    } finally {
      signal?.removeEventListener('abort', onAbort);
      this.stores.off('event', onEvent);
    }
  }

  private place(span: Span__Output | null): Place {
    if (span === null) throw invalidArgument('NO_SPAN', 'a span names a store (store_id, offset) or a daemon-mapped address');
    if (u64(span.storeId) !== 0n) return { store: this.stores.find({ id: u64(span.storeId), name: '' }), offset: u64(span.offset) };
    return { address: u64(span.address) + u64(span.offset) };
  }

  private async readAt(place: Place, caller: bigint, offset: bigint, length: bigint): Promise<Buffer> {
    if ('store' in place) return this.stores.readChunk(place.store, place.offset + offset, length);
    const chunks: Buffer[] = [];
    for await (const chunk of this.registry.read(caller, place.address + offset, length)) chunks.push(chunk.data);
    return Buffer.concat(chunks);
  }

  private async writeAt(place: Place, caller: bigint, offset: bigint, data: Buffer): Promise<void> {
    if ('store' in place) return this.stores.writeChunk(place.store, place.offset + offset, data);
    return this.registry.write(caller, place.address + offset, data);
  }

  /** Checks a whole range before any byte moves. */
  private checkPlace(place: Place, caller: bigint, length: bigint, write: boolean): void {
    if ('store' in place) this.stores.checkRange(place.store, place.offset, length, write);
    else this.registry.checkIo(caller, place.address, length, write);
  }

  /** Counts the whole operation on every store it touches: Detach waits for it to end. */
  private begin(...places: Place[]): () => void {
    const ends: Array<() => void> = [];
    try {
      for (const place of places) if ('store' in place) ends.push(this.stores.begin(place.store));
    } catch (error) {
      for (const end of ends) end();
      throw error;
    }
    return () => {
      for (const end of ends) end();
    };
  }

  async *read(request: DataReadRequest__Output, context: CallContext): AsyncGenerator<DataChunk> {
    const place = this.place(request.span);
    const length = u64(request.length);
    this.checkPlace(place, context.caller, length, false);
    const end = this.begin(place);
    try {
      for (let done = 0n; done < length; done += CHUNK) {
        const size = length - done < CHUNK ? length - done : CHUNK;
        yield { offset: String(done), data: await this.readAt(place, context.caller, done, size) };
      }
    } finally {
      end();
    }
  }

  async write(requests: AsyncIterable<DataWriteRequest__Output>, context: CallContext): Promise<DataWriteResponse> {
    let place: Place | undefined;
    let end: (() => void) | undefined;
    let written = 0n;
    try {
      for await (const request of requests) {
        if (place === undefined) {
          place = this.place(request.span);
          if ('store' in place) this.checkWriter(place.store, context);
          end = this.begin(place);
        }
        if (request.data.length === 0) continue;
        await this.writeAt(place, context.caller, written, request.data);
        written += BigInt(request.data.length);
      }
    } finally {
      end?.();
    }
    if (written === 0n) throw invalidArgument('ZERO_SIZE', 'Write received no bytes');
    return { bytesWritten: String(written) };
  }

  async fill(request: FillRequest__Output, context: CallContext): Promise<DataWriteResponse> {
    if (request.value > 255) throw invalidArgument('BAD_VALUE', `fill value ${request.value} is not a byte (0..255)`);
    const place = this.place(request.span);
    const length = u64(request.length);
    this.checkPlace(place, context.caller, length, true);
    if ('store' in place) this.checkWriter(place.store, context);
    const pattern = Buffer.alloc(Number(length < CHUNK ? length : CHUNK), request.value);
    const end = this.begin(place);
    try {
      for (let done = 0n; done < length; done += CHUNK) {
        const size = length - done < CHUNK ? length - done : CHUNK;
        await this.writeAt(place, context.caller, done, pattern.subarray(0, Number(size)));
      }
    } finally {
      end();
    }
    return { bytesWritten: String(length) };
  }

  async copy(request: CopyRequest__Output, context: CallContext): Promise<DataWriteResponse> {
    const source = this.place(request.source);
    const target = this.place(request.target);
    const length = u64(request.length);
    this.checkPlace(source, context.caller, length, false);
    this.checkPlace(target, context.caller, length, true);
    if ('store' in target) this.checkWriter(target.store, context);
    const end = this.begin(source, target);
    try {
      for (let done = 0n; done < length; done += CHUNK) {
        const size = length - done < CHUNK ? length - done : CHUNK;
        await this.writeAt(target, context.caller, done, await this.readAt(source, context.caller, done, size));
      }
    } finally {
      end();
    }
    return { bytesWritten: String(length) };
  }

  addToServer(server: grpc.Server, proto: VmmdProto, deps: HandlerDeps): void {
    server.addService(proto.vmmd.v1.Stores.service, {
      // A store made after its caller stopped waiting is detached again (handler.ts): nobody would know its id.
      CreateStore: unary(
        deps,
        'CreateStore',
        (r: CreateStoreRequest__Output, c) => this.createStore(r, c),
        (made, c) => this.undoStore(made, c),
      ),
      Attach: unary(
        deps,
        'Attach',
        (r: AttachRequest__Output, c) => this.attach(r, c),
        (made, c) => this.undoStore(made, c),
      ),
      Open: unary(deps, 'Open', (r: OpenRequest__Output, c) => this.open(r, c)),
      Close: unary(deps, 'Close', (r: CloseRequest__Output, c) => this.close(r, c)),
      Detach: unary(deps, 'Detach', (r: DetachRequest__Output, c) => this.detach(r, c)),
      List: unary(deps, 'List', () => this.list()),
      Watch: serverStream(deps, 'Watch', (r: WatchRequest__Output, c) => this.watch(r, c.signal), { tracked: false }),
      Read: serverStream(deps, 'Read', (r: DataReadRequest__Output, c) => this.read(r, c)),
      Write: clientStream(deps, 'Write', (requests: AsyncIterable<DataWriteRequest__Output>, c) => this.write(requests, c)),
      Fill: unary(deps, 'Fill', (r: FillRequest__Output, c) => this.fill(r, c)),
      Copy: unary(deps, 'Copy', (r: CopyRequest__Output, c) => this.copy(r, c)),
    });
  }
}
