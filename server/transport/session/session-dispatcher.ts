/**
 * The session socket's requests: one handler per message type, each turning
 * the message straight into the registry's own argument types and answering
 * with the reply (and descriptor) the transport sends. Services and these
 * handlers are peers over the registry. Adding a socket message is adding
 * one entry to HANDLERS.
 */
import { status as Status } from '@grpc/grpc-js';
import type { AllocateMessage, AllocatedMessage, ExportedMessage, OpenedMessage, ReleasedMessage, SharedMessage } from '../../../common/protocol';
import { TRANSFER_ID_PATTERN } from '../../../common/protocol';
import type { Registry } from '../../registry';
import type { CreateArgs, ExportArgs } from '../../registry/records';
import { toWireStore } from '../wire';
import { Answer, ReclaimSummary, ReclaimTarget, refuseMessage, RequestMessage, Session, SessionServices } from './sessions';
import { openFor, StoreCaller } from '../../stores/store-writers';
import type { StoreRegistry } from '../../stores/stores';

const DECIMAL_U64 = /^(0|[1-9][0-9]{0,19})$/;
const U64_LIMIT = 1n << 64n;

/** What a handler needs from the daemon. */
export interface DispatcherDeps {
  registry: Registry;
  /** Stores, for open. */
  stores: StoreRegistry;
  /** Runs before the registry reclaims a closed session's objects, in order (stores drop its opens, staging unmaps). */
  reclaimers: Array<(session: bigint) => Promise<void>>;
  /**
   * Who may call what (server/transport/grpc/access.ts), checked before each request as
   * before the RPC of the same name; throws the RPC's refusal.
   */
  check?: (session: Session, method: string) => void;
  /** Who the session's peer is for the store rules (its uid, whether it is an admin: server/transport/grpc/access.ts); default: its uid, no admin. */
  who?: (session: Session) => StoreCaller;
}

interface Handler<Parsed> {
  /** The RPC this message is the socket's form of: its access rule applies. */
  method: string;
  /** The message's fields checked and converted; a string is why the message is refused (BAD_MESSAGE). */
  parse(message: RequestMessage): Parsed | string;
  answer(session: Session, parsed: Parsed, deps: DispatcherDeps): Promise<Answer> | Answer;
}

const shown = (value: unknown) => JSON.stringify(value)?.slice(0, 64);

/** A request id: a decimal uint64 string above 0; undefined when it is, else why not. */
function badRequestId(type: string, request: unknown): string | undefined {
  if (typeof request === 'string' && TRANSFER_ID_PATTERN.test(request) && BigInt(request) < U64_LIMIT) return undefined;
  return `${type}: request ${shown(request)} is not a decimal uint64 string above 0`;
}

/** A uint64 field: its value, or why it is refused. */
function u64Field(type: string, field: string, value: unknown): bigint | string {
  if (typeof value !== 'string' || !DECIMAL_U64.test(value) || BigInt(value) >= U64_LIMIT) {
    return `${type}: ${field} ${shown(value)} is not a decimal uint64 string`;
  }
  return BigInt(value);
}

/** The fields of an `allocated` or `exported` answer. */
function describeExport(registry: Registry, request: string, allocation: Awaited<ReturnType<Registry['exportHandle']>>['allocation']) {
  return {
    request,
    allocation: String(allocation.id),
    size: String(allocation.size),
    device: allocation.device,
    deviceUuid: registry.devices[allocation.device]?.uuid ?? '',
    granularity: String(allocation.granularity),
    location: { type: allocation.location.type, id: allocation.location.id },
  };
}

/** Allocate: Create and Export in one round trip, the descriptor attached to the answer. */
const allocate: Handler<{ request: string; args: CreateArgs; again: boolean }> = {
  method: 'Allocate',
  parse({ request, size, location, again }) {
    if (again !== undefined && typeof again !== 'boolean') return `allocate: again ${shown(again)} is not true or false`;
    const badId = badRequestId('allocate', request);
    if (badId !== undefined) return badId;
    const bytes = u64Field('allocate', 'size', size);
    if (typeof bytes === 'string') return bytes;
    let where: AllocateMessage['location'] = { type: 'DEVICE', id: 0 };
    if (location !== undefined) {
      const { type: named, id } = (location ?? {}) as { type?: unknown; id?: unknown };
      // The proto's JSON (and grpcurl's) spelling is accepted too: LOCATION_TYPE_DEVICE is DEVICE.
      const kind = typeof named === 'string' ? named.replace(/^LOCATION_TYPE_/, '') : named;
      if (typeof location !== 'object' || location === null || (kind !== 'DEVICE' && kind !== 'HOST_NUMA') || !Number.isInteger(id) || (id as number) < 0 || (id as number) > 0x7fffffff) {
        return 'allocate: location must be {"type": "DEVICE" or "HOST_NUMA" (or LOCATION_TYPE_DEVICE, LOCATION_TYPE_HOST_NUMA), "id": an integer from 0}';
      }
      where = { type: kind, id: id as number };
    }
    return { request: request as string, args: { size: bytes, location: where, handleType: 'POSIX_FD', request: request as string }, again: again === true };
  },
  async answer(session, { request, args, again }, { registry }) {
    // Sent again after a restart cut off its answer: the allocation the first one made (recorded, then parked,
    // with its request id) is this answer, exported anew, rather than a second allocation.
    const made = again ? [...registry.allocations.all()].find((allocation) => allocation.owner === session.id && allocation.request === request) : undefined;
    if (made !== undefined) {
      const exported = await registry.exportHandle(session.id, { allocationId: made.id, handleType: 'POSIX_FD', shareKey: '' });
      return { reply: { type: 'allocated', ...describeExport(registry, request, exported.allocation) }, fd: exported.fd };
    }
    const { allocation, fd } = await registry.createExported(session.id, args, (error) =>
      session.log.error({ err: error }, 'allocate: releasing the allocation after a failed export failed'),
    );
    const reply: AllocatedMessage = { type: 'allocated', ...describeExport(registry, request, allocation) };
    // The client never learns of an allocation whose answer did not reach it: it is released again.
    return { reply, fd, unsent: () => registry.release(session.id, allocation.id) };
  },
};

/** An allocation named by a request: release and share. */
function allocationRequest(type: string, { request, allocation }: RequestMessage): { request: string; allocation: bigint } | string {
  const badId = badRequestId(type, request);
  if (badId !== undefined) return badId;
  const id = u64Field(type, 'allocation', allocation);
  return typeof id === 'string' ? id : { request: request as string, allocation: id };
}

/** A free that failed after its release was answered is tried again after these delays; then the reclaim tries. */
export const FREE_RETRY_MS = [100, 1_000, 10_000];

/**
 * A free that failed after the release was answered (the client was told
 * `freed`): the session hears of it once (an error message without a request
 * id: the client's 'daemon-error'), and the daemon tries the free again
 * after each of FREE_RETRY_MS; the allocation stays recorded and charged to
 * the session meanwhile. Past the last, the session's reclaim frees it (or a
 * Release by id).
 */
function freeFailedAfterAnswer(session: Session, registry: Registry, allocation: bigint, error: Error, attempt = 0): void {
  const delay = FREE_RETRY_MS[attempt];
  session.log.error(
    { err: error, allocation: String(allocation), attempt },
    `release: freeing the memory failed after the answer; the allocation stays, charged, ${delay === undefined ? 'until a Release or the session\'s reclaim frees it' : `and the daemon tries again in ${delay} ms`}`,
  );
  if (attempt === 0) {
    session.trySend({
      type: 'error',
      code: 'FREE_FAILED',
      status: Status.INTERNAL,
      message: `allocation ${allocation} was released, but freeing its memory failed (${error.message}); it stays charged to this session until the daemon's retries (${FREE_RETRY_MS.join(', ')} ms), a Release or the session's end free it`,
    });
  }
  if (delay === undefined) return;
  setTimeout(
    () => registry.retryFree(allocation).catch((again: Error) => freeFailedAfterAnswer(session, registry, allocation, again, attempt + 1)),
    delay,
  ).unref();
}

/**
 * Release: the Release RPC, its answer the reference counts left, sent once
 * the references are dropped and the free (if due) has started: the driver's
 * free runs after, off the answer's path. A free that fails then is told to
 * the session and tried again (freeFailedAfterAnswer).
 */
const release: Handler<{ request: string; allocation: bigint }> = {
  method: 'Release',
  parse: (message) => allocationRequest('release', message),
  async answer(session, { request, allocation }, { registry }) {
    const { result, freeing } = await registry.releaseAnswering(session.id, allocation);
    freeing.catch((error: Error) => freeFailedAfterAnswer(session, registry, allocation, error));
    const reply: ReleasedMessage = { type: 'released', request, allocation: String(allocation), ...result };
    return { reply };
  },
};

/** Share: the Share RPC, its answer the key. */
const share: Handler<{ request: string; allocation: bigint }> = {
  method: 'Share',
  parse: (message) => allocationRequest('share', message),
  answer(session, { request, allocation }, { registry }) {
    const reply: SharedMessage = { type: 'shared', request, allocation: String(allocation), shareKey: registry.share(session.id, allocation) };
    return { reply };
  },
};

/** Export: the Export RPC for a descriptor, attached to the answer instead of sent as a transfer. */
const exportAllocation: Handler<{ request: string; args: ExportArgs }> = {
  method: 'Export',
  parse(message) {
    const named = allocationRequest('export', message);
    if (typeof named === 'string') return named;
    const { shareKey } = message;
    if (shareKey !== undefined && (typeof shareKey !== 'string' || shareKey.length > 256)) {
      return `export: shareKey must be a string of at most 256 characters, not ${shown(shareKey)}`;
    }
    return { request: named.request, args: { allocationId: named.allocation, handleType: 'POSIX_FD', shareKey: shareKey ?? '' } };
  },
  async answer(session, { request, args }, { registry }) {
    const { allocation, fd } = await registry.exportHandle(session.id, args);
    const reply: ExportedMessage = { type: 'exported', ...describeExport(registry, request, allocation) };
    return { reply, fd };
  },
};

/** Open: the Stores.Open RPC, the descriptor attached to the answer; an open whose answer cannot be sent is dropped. */
const open: Handler<{ request: string; store: { id: string; name: string } | null; writable: boolean }> = {
  method: 'Open',
  parse({ request, store, writable }) {
    const badId = badRequestId('open', request);
    if (badId !== undefined) return badId;
    if (writable !== undefined && typeof writable !== 'boolean') return `open: writable must be true or false, not ${shown(writable)}`;
    if (store === undefined || store === null) return { request: request as string, store: null, writable: writable ?? false };
    if (typeof store !== 'object' || Array.isArray(store)) return `open: store must be {"id": a decimal uint64 string} or {"name": a string}, not ${shown(store)}`;
    const { id, name } = store as { id?: unknown; name?: unknown };
    const storeId = id === undefined ? 0n : u64Field('open', 'store.id', id);
    if (typeof storeId === 'string') return storeId;
    if (name !== undefined && typeof name !== 'string') return `open: store.name must be a string, not ${shown(name)}`;
    return { request: request as string, store: { id: String(storeId), name: name ?? '' }, writable: writable ?? false };
  },
  async answer(session, { request, store: ref, writable }, { stores, who }) {
    const store = stores.findRef(ref);
    // The store rules of Stores.Open: a writable open by a writer only, others a descriptor that cannot write.
    const { fd, descriptorReadOnly } = await openFor(stores, session.id, store, writable, who?.(session) ?? { peer: session.peer, admin: false });
    const reply: OpenedMessage = {
      type: 'opened',
      request,
      store: toWireStore(store),
      granularity: String(store.memory.granularity),
      mappedSize: String(store.memory.mappedSize),
      descriptorReadOnly,
    };
    return { reply, fd, unsent: () => stores.close(session.id, store) };
  },
};

/** Ping: one round trip, the nonce echoed. */
const ping: Handler<{ nonce?: string }> = {
  method: 'Ping',
  parse: ({ nonce }) => (nonce === undefined ? {} : { nonce: String(nonce).slice(0, 64) }),
  answer: (_session, parsed) => ({ reply: { type: 'pong', ...parsed } }),
};

/** Messages a client may send, besides transfers (the transport's own). */
const HANDLERS: Record<string, Handler<never>> = { allocate, release, share, export: exportAllocation, open, ping } as Record<string, Handler<unknown>> as Record<
  string,
  Handler<never>
>;

/** Requests whose answer carries a descriptor: refused before they act when the client has too many unread. */
const DESCRIPTOR_ANSWERS = new Set(['allocate', 'export', 'open']);

/** Messages only the daemon sends: a client sending one is refused by name. */
const DAEMON_MESSAGES = new Set(['hello', 'error', 'pong', 'allocated', 'released', 'shared', 'exported', 'opened']);

export class SessionDispatcher implements SessionServices {
  constructor(private readonly deps: DispatcherDeps) {}

  /** @throws refuseMessage BAD_MESSAGE, UNEXPECTED_DESCRIPTOR; the handler's errors */
  answer(session: Session, message: RequestMessage, fd: number): Promise<Answer> | Answer {
    const handler = Object.hasOwn(HANDLERS, message.type) ? HANDLERS[message.type] : undefined;
    if (handler === undefined) {
      throw refuseMessage(
        'BAD_MESSAGE',
        DAEMON_MESSAGES.has(message.type) ? `clients may not send "${message.type}" messages` : `unknown message type ${JSON.stringify(message.type).slice(0, 64)}`,
      );
    }
    const parsed = handler.parse(message);
    if (typeof parsed === 'string') throw refuseMessage('BAD_MESSAGE', parsed);
    if (fd >= 0) throw refuseMessage('UNEXPECTED_DESCRIPTOR', 'only transfer messages may carry a descriptor');
    if (handler.method !== 'Ping') this.deps.check?.(session, handler.method);
    if (DESCRIPTOR_ANSWERS.has(message.type)) session.checkDescriptorRoom();
    return handler.answer(session, parsed, this.deps);
  }

  /** The RPC a message type is the socket's form of; undefined for types no handler takes. */
  methodOf(type: string): string | undefined {
    return Object.hasOwn(HANDLERS, type) ? HANDLERS[type].method : undefined;
  }

  /** Each step runs whatever the one before it did: a failure is logged, never a reason to leave objects behind. */
  async reclaim(session: ReclaimTarget): Promise<ReclaimSummary> {
    // What the session holds once its calls have drained is what the steps below free.
    const held = this.deps.registry.snapshot();
    const owner = String(session.id);
    const allocations = held.allocations.filter((allocation) => allocation.owner === owner);
    const summary: ReclaimSummary = {
      allocations: allocations.length,
      bytes: String(allocations.reduce((total, allocation) => total + BigInt(allocation.size), 0n)),
      reservations: held.reservations.filter((reservation) => reservation.owner === owner).length,
    };
    for (const step of [...this.deps.reclaimers, (id: bigint) => this.deps.registry.reclaim(id)]) {
      try {
        await step(session.id);
      } catch (error) {
        session.log.error({ err: error, failures: (error as AggregateError).errors?.length }, 'reclaiming the session failed in part');
      }
    }
    return summary;
  }
}
