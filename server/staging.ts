/**
 * Staging buffers: the bulk path of Read and Write. A session sends a memfd
 * of its own on the session socket; the daemon maps it, and ReadStaged /
 * WriteStaged copy between mapped memory and it on worker threads, so that
 * bytes never cross gRPC (whose HTTP/2 framing in JavaScript tops out near
 * 0.3 GB/s, bench/grpc-stream-floor.js). One buffer per session; it goes
 * with the session.
 */
import { addon } from '../native';
import { detachView, pageSize } from '../native/mapping';
import { admitClientMemfd } from './client-memfd';
import { failedPrecondition, invalidArgument, outOfRange } from './errors';
import { MemfdMemory } from './store-memory';

/** The largest staging buffer a session may open. */
export const MAX_STAGING_BYTES = 1n << 30n;

interface Staging {
  memory: MemfdMemory;
  size: bigint;
  buffer: ArrayBuffer;
  // Invariant: copies in flight; the mapping is released only when none is.
  busy: number;
  closing?: () => void;
}

export class StagingBuffers {
  // Invariant: one mapped staging buffer per session id.
  private readonly bySession = new Map<bigint, Staging>();

  /**
   * Maps `fd` (taken over: closed on failure too) as the session's staging buffer, replacing any earlier one.
   * @throws INVALID_ARGUMENT BAD_DESCRIPTOR (admitClientMemfd's rules; empty, not page-sized, larger than MAX_STAGING_BYTES)
   */
  async open(session: bigint, fd: number): Promise<bigint> {
    let memory: MemfdMemory;
    let size: bigint;
    try {
      size = admitClientMemfd(fd, { what: 'a staging buffer', writable: true }).size;
      const page = pageSize();
      if (size === 0n || size % page !== 0n || size > MAX_STAGING_BYTES) {
        throw invalidArgument('BAD_DESCRIPTOR', `a staging buffer's size ${size} must be a positive multiple of ${page} bytes, at most ${MAX_STAGING_BYTES}`);
      }
    } catch (error) {
      addon.close(fd);
      throw error;
    }
    try {
      // Takes fd over, and closes it if the mapping fails.
      memory = MemfdMemory.map(fd, size, false);
    } catch (error) {
      throw invalidArgument('BAD_DESCRIPTOR', `the staging descriptor cannot be mapped: ${(error as Error).message}`);
    }
    await this.close(session);
    this.bySession.set(session, { memory, size, buffer: memory.view(), busy: 0 });
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

  /** Unmaps the session's staging buffer once no copy uses it. */
  async close(session: bigint): Promise<void> {
    const staging = this.bySession.get(session);
    if (staging === undefined) return;
    this.bySession.delete(session);
    if (staging.busy > 0) await new Promise<void>((resolve) => (staging.closing = resolve));
    detachView(staging.buffer);
    await staging.memory.release();
  }
}
