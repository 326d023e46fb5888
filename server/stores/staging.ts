/**
 * Staging buffers: the bulk path of Read and Write. A session sends a memfd
 * of its own on the session socket; the daemon maps it, and ReadStaged /
 * WriteStaged copy between mapped memory and it on worker threads, so that
 * bytes never cross gRPC (whose HTTP/2 framing in JavaScript tops out near
 * 0.3 GB/s, bench/grpc-stream-floor.js). One buffer per session; it goes
 * with the session.
 */
import { addon } from '../../native';
import { detachView, pageSize } from '../../native/mapping';
import { admitClientMemfd } from '../backends/client-memfd';
import { failedPrecondition, invalidArgument, outOfRange, resourceExhausted } from '../errors';
import { MemfdMemory } from './store-memory';
import { MAX_STAGING_BYTES as CLIENT_MAX_STAGING_BYTES } from '../../common/client-constants';

/** The largest staging buffer a session may open. */
export const MAX_STAGING_BYTES = BigInt(CLIENT_MAX_STAGING_BYTES);
/**
 * The largest staging buffer the daemon page-locks (cuda): page-locked
 * memory is the host's to spare, so a larger one is copied through as it is
 * (the driver stages those copies itself, at memcpy speed).
 */
export const MAX_PINNED_STAGING_BYTES = 256n << 20n;

/**
 * Page-locking of the daemon's view of staging buffers, where the backend
 * copies with a DMA engine (cuda: cuMemHostRegister, on a driver thread):
 * copies between device memory and page-locked memory run at the copy
 * engine's speed instead of through the driver's own bounce buffers.
 */
export interface StagingPinning {
  pin(address: bigint, size: bigint): Promise<void>;
  unpin(address: bigint): Promise<void>;
}

interface Staging {
  memory: MemfdMemory;
  size: bigint;
  buffer: ArrayBuffer;
  /** Page-locked: unpinned before it is unmapped. */
  pinned: boolean;
  // Invariant: copies in flight; the mapping is unpinned and released only when none is.
  busy: number;
  closing?: () => void;
  /** Gives the buffer's size back to its uid's budget: once, when the buffer is let go. */
  uncharge: () => void;
}

/**
 * Counts a buffer's size against its holder before it is mapped (the daemon's
 * copies fault its pages into the daemon's own memory), and returns what
 * gives it back.
 * @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED
 */
export type StagingCharge = (size: bigint) => () => void;

export class StagingBuffers {
  // Invariant: one mapped staging buffer per session id.
  private readonly bySession = new Map<bigint, Staging>();

  /**
   * @param pinning page-locks buffers up to MAX_PINNED_STAGING_BYTES (none on the host backend: its copies are memcpy)
   * @param warn hears a buffer that could not be page-locked (it is used as it is) or unpinned
   */
  constructor(
    private readonly pinning?: StagingPinning,
    private readonly warn: (message: string) => void = () => undefined,
  ) {}

  /**
   * Maps `fd` (taken over: closed on failure too) as the session's staging buffer, replacing any earlier one.
   * @param charge counts the buffer's size before it is mapped (the earlier buffer, mapped until the swap, still counts then)
   * @throws INVALID_ARGUMENT BAD_DESCRIPTOR (admitClientMemfd's rules; empty, not page-sized, larger than MAX_STAGING_BYTES);
   *   RESOURCE_EXHAUSTED BUDGET_EXCEEDED (charge's refusal), DAEMON_MAP_FAILED (the daemon's own mmap failed: address space, mappings)
   */
  async open(session: bigint, fd: number, charge: StagingCharge = () => () => undefined): Promise<bigint> {
    let memory: MemfdMemory;
    let size: bigint;
    let uncharge: () => void;
    try {
      size = admitClientMemfd(fd, { what: 'a staging buffer', writable: true }).size;
      const page = pageSize();
      if (size === 0n || size % page !== 0n || size > MAX_STAGING_BYTES) {
        throw invalidArgument('BAD_DESCRIPTOR', `a staging buffer's size ${size} must be a positive multiple of ${page} bytes, at most ${MAX_STAGING_BYTES}`);
      }
      uncharge = charge(size);
    } catch (error) {
      addon.close(fd);
      throw error;
    }
    try {
      // Takes fd over, and closes it if the mapping fails.
      memory = MemfdMemory.map(fd, size, false);
    } catch (error) {
      uncharge();
      // Admitted, the descriptor allows the mapping: only seals added since (EPERM, EACCES) are the client's doing.
      const code = (error as { code?: unknown }).code;
      if (code === 'EPERM' || code === 'EACCES')
        throw invalidArgument('BAD_DESCRIPTOR', `the staging descriptor cannot be mapped: ${(error as Error).message}`);
      throw resourceExhausted(
        'DAEMON_MAP_FAILED',
        `the daemon could not map a staging buffer of ${size} bytes (${(error as Error).message}): it is short of address space or mappings; try again later`,
      );
    }
    let pinned = false;
    if (this.pinning !== undefined && size <= MAX_PINNED_STAGING_BYTES) {
      try {
        await this.pinning.pin(memory.address, size);
        pinned = true;
      } catch (error) {
        this.warn(`a staging buffer of ${size} bytes could not be page-locked (${(error as Error).message}): its copies go through the driver's staging`);
      }
    }
    // The swap is one synchronous step: calls of one session at once each replace the one before, and every buffer replaced is let go.
    const previous = this.bySession.get(session);
    this.bySession.set(session, { memory, size, buffer: memory.view(), pinned, busy: 0, uncharge });
    if (previous !== undefined) await this.retire(previous);
    return size;
  }

  /**
   * Runs `copy` on [offset, +length) of the session's staging buffer, as a Buffer view.
   * @throws FAILED_PRECONDITION NO_STAGING; OUT_OF_RANGE BEYOND_STAGING; INVALID_ARGUMENT ZERO_SIZE
   */
  async use<T>(session: bigint, offset: bigint, length: bigint, copy: (view: Buffer) => Promise<T>): Promise<T> {
    const staging = this.bySession.get(session);
    if (staging === undefined) {
      throw failedPrecondition('NO_STAGING', 'this session has no staging buffer: call OpenStaging first');
    }
    if (length === 0n) throw invalidArgument('ZERO_SIZE', 'a staged copy needs a length greater than 0');
    if (offset + length > staging.size) {
      throw outOfRange('BEYOND_STAGING', `[${offset}, +${length}) is outside the staging buffer of ${staging.size} bytes`);
    }
    staging.busy++;
    try {
      return await copy(Buffer.from(staging.buffer, Number(offset), Number(length)));
    } finally {
      staging.busy--;
      if (staging.busy === 0) staging.closing?.();
    }
  }

  /** Whether the session's staging buffer is page-locked (for tests and logs). */
  isPinned(session: bigint): boolean {
    return this.bySession.get(session)?.pinned ?? false;
  }

  /** Unpins and unmaps the session's staging buffer once no copy uses it. */
  async close(session: bigint): Promise<void> {
    const staging = this.bySession.get(session);
    if (staging === undefined) return;
    this.bySession.delete(session);
    await this.retire(staging);
  }

  private async retire(staging: Staging): Promise<void> {
    if (staging.busy > 0) await new Promise<void>((resolve) => (staging.closing = resolve));
    if (staging.pinned) {
      // A failed unpin leaves the pages locked until the daemon exits; the unmap still goes ahead.
      await this.pinning!.unpin(staging.memory.address).catch((error: Error) => this.warn(`unpinning a staging buffer failed: ${error.message}`));
    }
    detachView(staging.buffer);
    try {
      await staging.memory.release();
    } finally {
      staging.uncharge();
    }
  }
}
