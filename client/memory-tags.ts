/**
 * Sleepers by tag, for one client (client.tags): the groups of mappings and
 * the memory managers' pools that `sleep(tag)` and `wake(tag)` act on, in the
 * order they were registered.
 */
import { status as Status } from '@grpc/grpc-js';
import { VmmdError } from './errors';
import { SleepClient, Sleeper, SleepOptions, SleepReport, TaggedMemory, TagOptions, WakeOptions, WakeReport } from './sleep-wake';

/**
 * Sleepers by tag, for one client: what `sleep(tag)` and `wake(tag)` act on.
 * Invariant: each tag names the sleepers registered under it, in order.
 */
export class MemoryTags {
  private readonly tags = new Map<string, Sleeper[]>();

  constructor(private readonly client: SleepClient) {}

  /** The tag's group of mappings (made on first use, with `options`; later calls' options are ignored: see setPrepareOffload). */
  group(tag: string, options: TagOptions = {}): TaggedMemory {
    const sleepers = this.tags.get(tag) ?? [];
    let group = sleepers.find((sleeper): sleeper is TaggedMemory => sleeper instanceof TaggedMemory);
    if (group === undefined) {
      group = new TaggedMemory(this.client, tag, options);
      this.tags.set(tag, [...sleepers, group]);
    }
    return group;
  }

  /** Registers a sleeper (a memory manager's pool) under a tag. */
  register(tag: string, sleeper: Sleeper): void {
    this.tags.set(tag, [...(this.tags.get(tag) ?? []), sleeper]);
  }

  isAsleep(tag: string): boolean {
    const sleepers = this.tags.get(tag) ?? [];
    return sleepers.length > 0 && sleepers.every((sleeper) => sleeper.asleep);
  }

  /**
   * Puts every sleeper of the tag to sleep, in order.
   * @throws VmmdError NOT_FOUND NOT_VMMD_MEMORY (no such tag); a sleeper's refusal (those before it sleep)
   */
  async sleep(tag: string, options: SleepOptions = {}): Promise<SleepReport> {
    const total: SleepReport = { offloadedBytes: 0n, releasedBytes: 0n };
    for (const sleeper of this.sleepers(tag)) {
      if (sleeper.asleep) continue;
      const report = await sleeper.sleep(options);
      total.offloadedBytes += report.offloadedBytes;
      total.releasedBytes += report.releasedBytes;
    }
    return total;
  }

  /**
   * Wakes every sleeper of the tag, in order.
   * @throws VmmdError NOT_FOUND NOT_VMMD_MEMORY (no such tag); a sleeper's refusal (it and those after it stay asleep)
   */
  async wake(tag: string, options: WakeOptions = {}): Promise<WakeReport> {
    const total: WakeReport = { restoredBytes: 0n, waitedMs: 0 };
    for (const sleeper of this.sleepers(tag)) {
      if (!sleeper.asleep) continue;
      const report = await sleeper.wake(options);
      total.restoredBytes += report.restoredBytes;
      total.waitedMs = Math.max(total.waitedMs, report.waitedMs);
    }
    return total;
  }

  private sleepers(tag: string): Sleeper[] {
    const sleepers = this.tags.get(tag);
    if (sleepers === undefined) throw new VmmdError('NOT_VMMD_MEMORY', Status.NOT_FOUND, `no memory is tagged "${tag}" in this client`);
    return sleepers;
  }
}
