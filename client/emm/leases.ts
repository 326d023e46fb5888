/**
 * The NBEP 7 manager's allocations of the daemon, each mapped into this
 * process: leased (the one held ahead for its size, else one Allocate round
 * trip) and given back without waiting (the release sent, the unmap behind
 * it), with the unmaps and releases still in flight until settle().
 */
import { status as Status } from '@grpc/grpc-js';
import { flushUnmaps } from '../../native/mapping';
import { native } from '../../native/client';
import type { VmmdClient } from '../connection';
import { VmmdError } from '../errors';
import { InFlight } from '../in-flight';
import type { ImportedMemory } from '../local-memory';
import { AheadSettings, AllocationsAhead, checkAhead, Received } from './ahead';

/** One allocation of the daemon's, mapped into this process. */
export interface Lease {
  allocationId: bigint;
  memory: ImportedMemory;
  shareKey?: string;
}

/** Where the manager's memory lives: the device, or host memory near it (unified memory, memhostalloc). */
export type Location = { type: 'LOCATION_TYPE_DEVICE' | 'LOCATION_TYPE_HOST_NUMA'; id: number };

export class DaemonLeases {
  // The unmaps that frees started and did not wait for (a driver thread on cuda runs them).
  private readonly unmaps = new InFlight();
  // The releases that frees sent and did not wait for the answer of.
  private readonly releases = new InFlight();
  // Give-backs that wait for something first (a sleep or wake under way); they start unmaps and releases when done.
  private readonly waiting = new InFlight();
  /** Allocations received before a lease asks for them (`depth` per size asked for repeatedly). */
  readonly ahead: AllocationsAhead<Location>;

  /** @throws VmmdError INVALID_ARGUMENT BAD_CONFIG for bad allocations-ahead settings */
  constructor(
    private readonly client: VmmdClient,
    ahead: AheadSettings,
  ) {
    this.ahead = new AllocationsAhead<Location>(
      checkAhead(ahead),
      {
        allocate: (size, location) => this.client.vmm.allocateUnmapped(size, location, false),
        giveBack: (received) => this.giveBackUnmapped(received),
      },
      (size, location) => `${location.type}:${location.id}:${size}`,
    );
  }

  /**
   * A new allocation of the daemon's, mapped here: the one received ahead for
   * this size (the next one asked for as it is taken), else one Allocate round trip.
   */
  async lease(size: bigint, location: Location): Promise<Lease> {
    const hostAccess = location.type === 'LOCATION_TYPE_HOST_NUMA';
    const ahead = this.ahead.take(size, location);
    const received = ahead === undefined ? undefined : await ahead;
    let memory: ImportedMemory;
    if (received !== undefined) {
      memory = await this.client.vmm.mapAllocated(received, hostAccess);
    } else {
      memory = await this.client.vmm.allocate({ size, location }, { hostAccess });
      this.ahead.noteAllocated(size, location);
    }
    return { allocationId: memory.allocationId, memory };
  }

  /**
   * Gives an allocation back without waiting, as an NBEP 7 free does not:
   * the release is sent at once on the session socket and its answer not
   * waited for (the daemon takes this session's requests in order, and a
   * create over a quota waits for the frees in flight), the unmap runs behind
   * it (after any copy still in flight on the memory, on a driver thread on
   * cuda), and the address range goes back to the arena once unmapped. The
   * mapping keeps the memory alive until then. A release that fails is a
   * warning; settle() waits for both.
   */
  giveBack(lease: Lease): void {
    this.unmapInBackground(lease.memory);
    this.release(lease.allocationId);
  }

  /** Closes `memory` here without waiting: reads and writes on it are refused from now, the unmap follows. */
  unmapInBackground(memory: ImportedMemory): void {
    this.unmaps
      .track(memory.close({ gather: true }))
      .catch((error: Error) => process.emitWarning(`vmmd: unmapping allocation ${memory.allocationId} failed: ${error.message}`));
  }

  /** Tracks a give-back that waits for something first until it is done; a failure is a warning. settle() waits for it. */
  after(work: Promise<unknown>): void {
    void this.waiting.track(work).catch((error: Error) => process.emitWarning(`vmmd: giving memory back failed: ${error.message}`));
  }

  /**
   * Resolves once every give-back waiting (after()) is done, every unmap started is done (those gathered for later go
   * to the driver now) and every release sent is answered.
   */
  async settle(): Promise<void> {
    await this.waiting.drain();
    flushUnmaps();
    await this.unmaps.drain();
    await this.releases.drain();
  }

  /** An allocation received ahead and never mapped goes back: its descriptor closed, its release not waited for. */
  private giveBackUnmapped(received: Received): void {
    native.close(received.fd);
    // A closed client's session is gone, and the daemon reclaimed the allocation with it.
    if (this.client.session.closed) return;
    this.release(BigInt(received.message.allocationId));
  }

  /** Sends the release of an allocation of this session's and does not wait for its answer (settle() does). */
  private release(allocationId: bigint): void {
    const released = this.client.vmm.release({ allocationId }).then(
      () => undefined,
      (error: unknown) => {
        // The session may be gone already: the daemon reclaimed the allocation with it.
        if (error instanceof VmmdError && (error.code === 'SESSION_LOST' || error.status === Status.UNAUTHENTICATED)) return;
        process.emitWarning(`vmmd: releasing allocation ${allocationId} failed: ${(error as Error).message}`);
      },
    );
    void this.releases.track(released);
  }
}
