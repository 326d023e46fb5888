/**
 * Bulk copies between a file and mapped memory through page-locked buffers
 * (the file is read while the copy engine works): on cuda, a few buffers of this process registered with
 * cuMemHostRegister, each going round file read → device copy (or device
 * copy → file write), several at once, so that reading the file, which runs
 * on the thread pool, overlaps the copy engine's DMA. Every copy resolves
 * only once its bytes are in place (unmapping under a copy faults the
 * context), and the memory's close()
 * waits for any still running.
 */
import * as fs from 'node:fs';
import { status as Status } from '@grpc/grpc-js';
import { native } from '../native/client';
import { VmmdError } from './errors';
import type { ImportedMemory } from './local-memory';

/** Buffers going round at once: file reads and device copies of different buffers overlap. */
export const PINNED_SLOTS = 4;
/** Bytes of each buffer: large enough that each copy runs at the copy engine's speed. */
export const PINNED_SLOT_BYTES = 32 << 20;

/** Host buffers that bulk copies go round through. */
export interface CopyBuffers {
  readonly buffers: Buffer[];
  /** Called once, when no copy or file operation uses the buffers any more. */
  free(): void;
}

/** Page-locked host buffers for one device, unregistered by free(). */
export class PinnedBuffers implements CopyBuffers {
  // Invariant: every buffer of `registered` is page-locked, at its own first byte.
  private readonly registered: Buffer[] = [];
  readonly buffers: Buffer[] = [];

  private constructor(private readonly device: number) {}

  /**
   * `count` buffers of `bytes` (page-aligned: plain memory of this process),
   * each page-locked for every CUDA context of this process. A buffer the
   * driver refuses to page-lock is used as it is (the copies stay correct,
   * at the driver's pageable speed), with a warning.
   * @throws VmmdError FAILED_PRECONDITION NO_CUDA
   */
  static allocate(device: number, count = PINNED_SLOTS, bytes = PINNED_SLOT_BYTES): PinnedBuffers {
    const loaded = native.cudaLoad();
    if (!loaded.loaded) throw new VmmdError('NO_CUDA', Status.FAILED_PRECONDITION, `this process cannot use CUDA: ${loaded.reason}`);
    const page = native.pageSize();
    const made = new PinnedBuffers(device);
    for (let i = 0; i < count; i++) {
      // Page-aligned inside a larger allocation: the pages locked are the buffer's alone.
      const backing = Buffer.allocUnsafeSlow(bytes + page);
      const skip = Number((BigInt(page) - (native.addressOf(backing) % BigInt(page))) % BigInt(page));
      const buffer = backing.subarray(skip, skip + bytes);
      try {
        native.cudaHostRegister(device, native.addressOf(buffer), BigInt(bytes), false);
        made.registered.push(buffer);
      } catch (error) {
        process.emitWarning(`vmmd: a copy buffer of ${bytes} bytes could not be page-locked (${(error as Error).message}); copying through it unpinned`);
      }
      made.buffers.push(buffer);
    }
    return made;
  }

  /** Unregisters every buffer; call once no copy uses them. */
  free(): void {
    for (const buffer of this.registered.splice(0)) native.cudaHostUnregister(this.device, native.addressOf(buffer));
  }
}

/** Reads exactly `length` bytes at `position` of `fd` into `buffer` (the thread pool), or fails with FILE_CHANGED. */
function readFully(fd: number, buffer: Buffer, length: number, position: number, name: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const step = (done: number) => {
      if (done === length) {
        resolve();
        return;
      }
      fs.read(fd, buffer, done, length - done, position + done, (error, read) => {
        if (error) reject(error);
        else if (read === 0) reject(new VmmdError('FILE_CHANGED', Status.ABORTED, `${name} shrank while it was read`));
        else step(done + read);
      });
    };
    step(0);
  });
}

/**
 * Copies `size` bytes of a regular file into `memory` from offset 0, through
 * page-locked buffers, several chunks in flight; `progress` hears the bytes
 * done so far. Resolves once every byte has landed in the memory.
 * @throws VmmdError FILE_CHANGED (the file shrank), NO_CUDA; the memory's write errors
 */
export async function copyFileToMemory(
  memory: ImportedMemory,
  fd: number,
  size: number,
  name: string,
  progress: (done: number) => void,
  pinned: CopyBuffers = PinnedBuffers.allocate(memory.device),
): Promise<void> {
  let next = 0;
  let done = 0;
  let failed = false;
  // Each buffer goes round on its own: claim the next chunk, read it, copy it, again.
  const cycle = async (buffer: Buffer) => {
    while (!failed && next < size) {
      const offset = next;
      const length = Math.min(buffer.length, size - offset);
      next += length;
      await readFully(fd, buffer, length, offset, name);
      await memory.write(offset, buffer.subarray(0, length));
      done += length;
      progress(done);
    }
  };
  const cycles = pinned.buffers.map((buffer) =>
    cycle(buffer).catch((error) => {
      failed = true;
      throw error;
    }),
  );
  try {
    await Promise.all(cycles);
  } finally {
    // At a failure the other buffers finish the read or copy they are in before they are unregistered.
    failed = true;
    await Promise.allSettled(cycles);
    pinned.free();
  }
}

/**
 * Copies `size` bytes of `memory` from offset 0 to `write` in order,
 * through page-locked buffers, the device copies of later chunks running
 * while earlier ones are written. `write` is called in order, one at a time.
 * @throws VmmdError NO_CUDA; the memory's read errors; `write`'s
 */
export async function copyMemoryToWriter(
  memory: ImportedMemory,
  size: number,
  write: (bytes: Buffer) => Promise<void>,
  progress: (done: number) => void,
  pinned: CopyBuffers = PinnedBuffers.allocate(memory.device),
): Promise<void> {
  const buffers = pinned.buffers;
  // Invariant: slot i's buffer is free once written[i] and copies[i] have settled.
  const written: Array<Promise<void>> = buffers.map(() => Promise.resolve());
  const copies: Array<Promise<unknown>> = buffers.map(() => Promise.resolve());
  let chain: Promise<void> = Promise.resolve();
  try {
    for (let offset = 0, index = 0; offset < size; index++) {
      const slot = index % buffers.length;
      const length = Math.min(buffers[slot].length, size - offset);
      await written[slot];
      const copied = memory.readInto(offset, buffers[slot].subarray(0, length));
      // Awaited in the chain below; a failure there must not also surface as unhandled.
      copied.catch(() => undefined);
      copies[slot] = copied;
      const at = offset + length;
      chain = chain.then(async () => {
        await write(await copied);
        progress(at);
      });
      written[slot] = chain;
      offset = at;
    }
    await chain;
  } finally {
    // No copy or write may still use a buffer when it is unregistered.
    await Promise.allSettled([...copies, ...written]);
    pinned.free();
  }
}
