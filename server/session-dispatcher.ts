/**
 * The session socket's requests: one handler per message type, each turning
 * the message straight into the registry's own argument types and answering
 * with the reply (and descriptor) the transport sends. Services and these
 * handlers are peers over the registry. Adding a socket message is adding
 * one entry to HANDLERS.
 */
import type { AllocateMessage, AllocatedMessage } from '../common/protocol';
import { TRANSFER_ID_PATTERN } from '../common/protocol';
import type { Registry } from './registry';
import type { CreateArgs } from './registry/records';
import { Answer, ReclaimSummary, refuseMessage, RequestMessage, Session, SessionServices } from './sessions';

const DECIMAL_U64 = /^(0|[1-9][0-9]{0,19})$/;
const U64_LIMIT = 1n << 64n;

/** What a handler needs from the daemon. */
export interface DispatcherDeps {
  registry: Registry;
  /** Runs before the registry reclaims a closed session's objects, in order (stores drop its opens, staging unmaps). */
  reclaimers: Array<(session: bigint) => Promise<void>>;
}

interface Handler<Parsed> {
  /** The message's fields checked and converted; a string is why the message is refused (BAD_MESSAGE). */
  parse(message: RequestMessage): Parsed | string;
  answer(session: Session, parsed: Parsed, deps: DispatcherDeps): Promise<Answer> | Answer;
}

/** Allocate: Create and Export in one round trip, the descriptor attached to the answer. */
const allocate: Handler<{ request: string; args: CreateArgs }> = {
  parse({ request, size, location }) {
    if (typeof request !== 'string' || !TRANSFER_ID_PATTERN.test(request) || BigInt(request) >= U64_LIMIT) {
      return `allocate: request ${JSON.stringify(request)?.slice(0, 64)} is not a decimal uint64 string above 0`;
    }
    if (typeof size !== 'string' || !DECIMAL_U64.test(size) || BigInt(size) >= U64_LIMIT) {
      return `allocate: size ${JSON.stringify(size)?.slice(0, 64)} is not a decimal uint64 string`;
    }
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
    return { request, args: { size: BigInt(size), location: where, handleType: 'POSIX_FD' } };
  },
  async answer(session, { request, args }, { registry }) {
    const { allocation, fd } = await registry.createExported(session.id, args, (error) =>
      session.log.error({ err: error }, 'allocate: releasing the allocation after a failed export failed'),
    );
    const reply: AllocatedMessage = {
      type: 'allocated',
      request,
      allocation: String(allocation.id),
      size: String(allocation.size),
      device: allocation.device,
      deviceUuid: registry.devices[allocation.device]?.uuid ?? '',
      granularity: String(allocation.granularity),
      location: { type: allocation.location.type, id: allocation.location.id },
    };
    return { reply, fd };
  },
};

/** Ping: one round trip, the nonce echoed. */
const ping: Handler<{ nonce?: string }> = {
  parse: ({ nonce }) => (nonce === undefined ? {} : { nonce: String(nonce).slice(0, 64) }),
  answer: (_session, parsed) => ({ reply: { type: 'pong', ...parsed } }),
};

/** Messages a client may send, besides transfers (the transport's own). */
const HANDLERS: Record<string, Handler<never>> = { allocate, ping } as Record<string, Handler<unknown>> as Record<string, Handler<never>>;

/** Messages only the daemon sends: a client sending one is refused by name. */
const DAEMON_MESSAGES = new Set(['hello', 'error', 'pong', 'allocated']);

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
    return handler.answer(session, parsed, this.deps);
  }

  /** Each step runs whatever the one before it did: a failure is logged, never a reason to leave objects behind. */
  async reclaim(session: Session): Promise<ReclaimSummary> {
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
