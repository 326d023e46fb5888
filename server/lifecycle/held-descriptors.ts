/**
 * The daemon's own hold of its parked descriptors (`--park held` where no
 * service manager's store runs: a shell, Docker without the keeper). The
 * parking and its journal work as with a store, but the copies live in the
 * serving process: a crash loses them with it, and a new daemon takes them
 * over through the hand-over socket (hand-over.ts) for an upgrade.
 */
import { addon } from '../../native';
import type { DescriptorParking } from './fd-store';
import { DescriptorStore } from './keeper';

export class HeldDescriptors implements DescriptorParking {
  // Invariant: one duplicate per descriptor parked and not removed, under its name: the process's own copies.
  private readonly held = new DescriptorStore();

  store(name: string, fd: number): void {
    this.held.put(name, [addon.dup(fd)]);
  }

  remove(name: string): void {
    this.held.drop(name);
  }

  /** Takes `fd` itself (a descriptor received from the daemon taken over) under `name`. */
  adopt(name: string, fd: number): void {
    this.held.put(name, [fd]);
  }

  /** What is held, in the order it came: the hand-over sends it as it is. */
  listing(): { fds: number[]; names: string[] } {
    return this.held.listing();
  }

  get size(): number {
    return this.held.size;
  }

  closeAll(): void {
    this.held.closeAll();
  }
}
