/**
 * The NBEP 7 manager's sleep and wake (client/sleep-wake.ts over its
 * leases): the group its chunks and large allocations sleep in, the copies
 * made ahead (prepareOffload), and leases given back while the pool sleeps or
 * while a sleep or wake runs.
 */
import { status as Status } from '@grpc/grpc-js';
import type { VmmdClient } from '../connection';
import { VmmdError } from '../errors';
import type { ImportedMemory } from '../local-memory';
import { PreparedOffload, SleepOptions, SleepReport, TaggedMemory, WakeOptions, WakeReport } from '../sleep-wake';
import type { DaemonLeases, Lease } from './leases';

export class PoolSleep {
  // While the pool sleeps: the group its chunks and large allocations sleep in (their addresses kept); undefined awake.
  private sleeping?: TaggedMemory;
  // With prepareOffload: the group every lease joins as it is made, holding its copy ahead; it is also the group that sleeps.
  private preparedGroup?: TaggedMemory;
  // Settles once the sleep or wake under way has ended and `sleeping` says which state it left; undefined when none runs.
  private transition?: Promise<void>;

  /** `members()`: the leases that sleep (the pool's chunks and large allocations), read at each sleep and wake. */
  constructor(
    private readonly client: VmmdClient,
    private readonly tag: string,
    prepareOffload: boolean,
    private readonly leases: DaemonLeases,
    private readonly members: () => Lease[],
  ) {
    if (prepareOffload) this.preparedGroup = new TaggedMemory(client, tag, { prepareOffload: true });
  }

  /** Whether the pool sleeps, or a sleep or wake of it runs. */
  get asleep(): boolean {
    return this.sleeping !== undefined;
  }

  /** What the pool holds ahead for its next offload (prepareOffload), or undefined without it. */
  get prepared(): PreparedOffload | undefined {
    return this.preparedGroup?.prepared;
  }

  /** A lease just made: with prepareOffload its copy is made ahead from now on. */
  joined(memory: ImportedMemory): void {
    this.preparedGroup?.add(memory);
  }

  /**
   * Puts every member to sleep at its address.
   * @throws VmmdError FAILED_PRECONDITION ASLEEP; the offload's refusals (awake and unchanged then)
   */
  sleep(options: SleepOptions): Promise<SleepReport> {
    if (this.sleeping !== undefined) return Promise.reject(new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, 'the pool sleeps already'));
    return this.during(this.sleepGroup(options));
  }

  private async sleepGroup(options: SleepOptions): Promise<SleepReport> {
    const group = this.preparedGroup ?? new TaggedMemory(this.client, this.tag);
    if (this.preparedGroup === undefined) for (const lease of this.members()) group.add(lease.memory);
    this.sleeping = group;
    try {
      return await group.sleep(options);
    } catch (error) {
      this.sleeping = undefined;
      throw error;
    }
  }

  /**
   * Wakes every member at its address, all of its memory as one request to the daemon.
   * @throws VmmdError FAILED_PRECONDITION ASLEEP (awake, or waking already); RESOURCE_EXHAUSTED OUT_OF_MEMORY (still asleep and intact)
   */
  wake(options: WakeOptions): Promise<WakeReport> {
    const group = this.sleeping;
    if (group === undefined) return Promise.reject(new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, 'the pool is awake'));
    if (this.transition !== undefined) return Promise.reject(new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, 'the pool is going to sleep or waking'));
    return this.during(this.wakeGroup(group, options));
  }

  private async wakeGroup(group: TaggedMemory, options: WakeOptions): Promise<WakeReport> {
    const report = await group.wake(options);
    for (const lease of this.members()) lease.allocationId = lease.memory.allocationId;
    this.sleeping = undefined;
    return report;
  }

  /**
   * Marks a sleep or wake under way until it ends: a lease given back meanwhile waits for it, then goes as the
   * pool is then, never racing the group (which refuses changes while it sleeps or wakes).
   */
  private during<T>(transition: Promise<T>): Promise<T> {
    const ended = transition.then(
      () => undefined,
      () => undefined,
    );
    this.transition = ended;
    void ended.then(() => {
      if (this.transition === ended) this.transition = undefined;
    });
    return transition;
  }

  /**
   * Gives a lease back. Awake: released (its copy made ahead goes too); asleep: its allocation went with the
   * sleep, so its offloaded bytes go and its range is unmapped; during a sleep or wake: once that has ended, as
   * the pool then is. The leases' settle() (flush, clearCaches) waits for it.
   */
  giveBack(lease: Lease): void {
    const transition = this.transition;
    if (transition !== undefined) {
      this.leases.after(transition.then(() => this.giveBack(lease)));
      return;
    }
    const group = this.sleeping;
    if (group === undefined) {
      // Its copy made ahead goes with it (one still being made goes when it arrives).
      this.preparedGroup?.forget(lease.memory).catch(() => undefined);
      // A lease freed while its pool woke was not among those the wake renumbered: its mapping names its allocation.
      lease.allocationId = lease.memory.allocationId;
      return this.leases.giveBack(lease);
    }
    this.leases.after(group.forget(lease.memory).then((asleep) => (asleep ? this.leases.unmapInBackground(lease.memory) : this.leases.giveBack(lease))));
  }

  /** After a reset gave every lease back: awake from now on; a group reset asleep stays asleep (its forgets finish on it), the leases to come join a new one. */
  reset(): void {
    if (this.preparedGroup !== undefined && this.sleeping === this.preparedGroup) {
      this.preparedGroup = new TaggedMemory(this.client, this.tag, { prepareOffload: true });
    }
    this.sleeping = undefined;
  }
}
