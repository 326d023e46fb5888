/**
 * The client's staging buffer: a memfd mapped here and, once sent on the
 * session socket (OpenStaging), in the daemon too. Large reads and writes go
 * through it in two halves, so that copying one half here overlaps the
 * daemon's copy of the other; only offsets travel over gRPC. One staged
 * transfer at a time per session (they share the buffer). A daemon that
 * refuses the buffer (its uid's staging budget is spent) is asked no more:
 * the caller streams over gRPC instead.
 */
import { SharedHostMemory } from './shared-memory';
import { status as Status } from '@grpc/grpc-js';
import { VmmdError } from './errors';

import { DEFAULT_STAGING_BYTES, STAGED_MIN_BYTES } from '../common/client-constants';

export { DEFAULT_STAGING_BYTES, STAGED_MIN_BYTES };

export interface StagedCalls {
  /** Sends the memfd on the session socket and names it in OpenStaging. */
  open(fd: number): Promise<void>;
  /** Mapped memory at `address` → staging at `offset`. */
  read(address: bigint, length: number, offset: number): Promise<unknown>;
  /** Staging at `offset` → mapped memory at `address`. */
  write(address: bigint, length: number, offset: number): Promise<unknown>;
}

/** Thrown by a staged copy when the daemon refused the buffer: nothing was copied, stream instead. */
export class StagingRefused extends Error {
  constructor(readonly refusal: VmmdError) {
    super(`the daemon refused the staging buffer: ${refusal.message}`);
    this.name = 'StagingRefused';
  }
}

export class StagingBuffer {
  /** The daemon refused the buffer for its uid's budget: this client streams from then on. */
  refused = false;
  // A memfd mapped here; the daemon maps the same pages once OpenStaging took it.
  private memory?: SharedHostMemory;
  private opening?: Promise<void>;
  // One staged transfer at a time: each waits for the one before.
  private queue: Promise<unknown> = Promise.resolve();

  constructor(
    private readonly size: number,
    private readonly calls: StagedCalls,
  ) {}

  /** Copies `length` bytes at `address` out of the daemon's memory, into `into` when given. */
  read(address: bigint, length: number, into?: Buffer): Promise<Buffer> {
    return this.serialized(async () => {
      const staging = await this.mapped();
      const half = this.size / 2;
      const out = into ?? Buffer.allocUnsafe(length);
      let pending = this.calls.read(address, Math.min(half, length), 0);
      for (let offset = 0, slot = 0; offset < length; slot = 1 - slot) {
        const count = Math.min(half, length - offset);
        await pending;
        const next = offset + count;
        if (next < length) pending = this.calls.read(address + BigInt(next), Math.min(half, length - next), (1 - slot) * half);
        staging.copy(out, offset, slot * half, slot * half + count);
        offset = next;
      }
      return out;
    });
  }

  /** Copies `data` into the daemon's memory at `address`. */
  write(address: bigint, data: Uint8Array): Promise<void> {
    return this.serialized(async () => {
      const staging = await this.mapped();
      const half = this.size / 2;
      const source = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
      const inFlight: Array<Promise<unknown> | undefined> = [undefined, undefined];
      for (let offset = 0, slot = 0; offset < source.length; slot = 1 - slot) {
        const count = Math.min(half, source.length - offset);
        // The half is free again once the daemon's copy out of it is done.
        await inFlight[slot];
        source.copy(staging, slot * half, offset, offset + count);
        inFlight[slot] = this.calls.write(address + BigInt(offset), count, slot * half);
        offset += count;
      }
      await Promise.all(inFlight);
    });
  }

  /** Unmaps the buffer here (the daemon unmaps its side with the session). */
  close(): void {
    this.memory?.free();
    this.memory = undefined;
    this.opening = undefined;
  }

  private serialized<T>(body: () => Promise<T>): Promise<T> {
    const run = this.queue.then(body, body);
    this.queue = run.catch(() => undefined);
    return run;
  }

  /** Creates, maps and opens the buffer on first use. */
  /** @throws StagingRefused when the daemon refuses the buffer BUDGET_EXCEEDED (now or before) */
  private async mapped(): Promise<Buffer> {
    if (this.refused) throw new StagingRefused(new VmmdError('BUDGET_EXCEEDED', Status.RESOURCE_EXHAUSTED, 'an earlier OpenStaging was refused'));
    this.opening ??= (async () => {
      const memory = SharedHostMemory.allocate(this.size);
      try {
        await this.calls.open(memory.fd);
      } catch (error) {
        memory.free();
        this.opening = undefined;
        if (error instanceof VmmdError && error.code === 'BUDGET_EXCEEDED') {
          this.refused = true;
          throw new StagingRefused(error);
        }
        throw error;
      }
      this.memory = memory;
    })();
    await this.opening;
    return Buffer.from(this.memory!.buffer);
  }
}
