/**
 * The daemon's lifecycle across its own restarts, composed for
 * server/app/daemon.ts: whether memory is parked (a file-descriptor store
 * named by NOTIFY_SOCKET, and `--park auto`; else the daemon's own hold with
 * `--park held`), the descriptors handed back at start or taken over from a
 * running daemon, the restore, the parked sessions' grace, and the freeze at
 * stop that leaves the parked state for the next start or the successor.
 */
import type { Logger } from 'pino';
import type { Backend } from '../backends/backend';
import type { AllocationSource, Registry } from '../registry';
import type { StoreRegistry } from '../stores/stores';
import type { SessionManager } from '../transport/session/sessions';
import { DescriptorParking, FdStoreClient, inheritedDescriptors } from './fd-store';
import { HeldDescriptors } from './held-descriptors';
import { Parking, ParkingSlot, SessionPeers } from './parking';
import { restoreParked, Restored } from './restore';

export class Lifecycle {
  private readonly slot: ParkingSlot = {};
  private grace?: NodeJS.Timeout;
  // Invariant: the descriptors handed back at start (or taken over), until restore() takes them.
  private inherited: Map<string, number[]>;

  /** @param store where descriptors are parked; undefined: nothing is parked */
  private constructor(
    private readonly store: DescriptorParking | undefined,
    inherited: Map<string, number[]>,
    private readonly log: Logger,
  ) {
    this.inherited = inherited;
  }

  /**
   * Reads LISTEN_FDS at once (before the daemon opens anything else): parking
   * goes to the store when `park` is not off and a store is there, else to
   * the daemon's own hold when `park` is held.
   */
  static fromEnvironment(park: 'auto' | 'held' | 'off', env: NodeJS.ProcessEnv, log: Logger): Lifecycle {
    if (park !== 'off' && env.NOTIFY_SOCKET) return new Lifecycle(new FdStoreClient(env.NOTIFY_SOCKET), inheritedDescriptors(env), log);
    return new Lifecycle(park === 'held' ? new HeldDescriptors() : undefined, new Map(), log);
  }

  /** Whether memory is parked: sessions can then be resumed after a restart or by a successor. */
  get parks(): boolean {
    return this.store !== undefined;
  }

  /** Whether the parked state outlives this process (a service manager's store): a stop then leaves it for the next start. */
  get outlivesProcess(): boolean {
    return this.store instanceof FdStoreClient;
  }

  /** Why this daemon cannot be taken over; undefined when it can (its parked state is its own). */
  handOverRefusal(): string | undefined {
    if (this.store instanceof HeldDescriptors) return undefined;
    return 'this daemon holds no parked state to hand over (it was started without --park held): its memory cannot leave its process';
  }

  /** The descriptors held in this process and their names, for a successor. */
  held(): { fds: number[]; names: string[] } {
    return this.store instanceof HeldDescriptors ? this.store.listing() : { fds: [], names: [] };
  }

  /** Closes what this process holds (after a hand-over: the successor has its own copies). */
  releaseHeld(): void {
    if (this.store instanceof HeldDescriptors) this.store.closeAll();
  }

  /**
   * The descriptors taken over from a running daemon: parked here (a copy
   * each), then restored as LISTEN_FDS would be.
   * @throws Error when the service manager handed back parked memory too (two states would mix)
   */
  takeOver(received: Map<string, number[]>): void {
    if (this.store === undefined) throw new Error('taking over needs parking (--park held)');
    if (this.inherited.size > 0) throw new Error('the service manager handed back parked memory (LISTEN_FDS): a take-over would mix two parked states');
    for (const [name, fds] of received) for (const fd of fds) this.store.store(name, fd);
    this.inherited = received;
  }

  get parking(): Parking | undefined {
    return this.slot.parking;
  }

  /** The registry's allocation source with the parking adaptor outermost (each memory's descriptor parked before it is recorded). */
  adapt(upstream: AllocationSource): AllocationSource {
    return this.store === undefined ? upstream : Parking.adaptor(this.slot, upstream);
  }

  /**
   * Takes back what was parked and starts parking; the parked sessions'
   * objects stay theirs for `graceMs`, then are reclaimed as if they had closed.
   * @throws the fd store's error when nothing can be parked
   */
  async restore(
    deps: { registry: Registry; stores: StoreRegistry; backend: Backend; sessions: SessionManager },
    graceMs: number,
  ): Promise<Restored | undefined> {
    if (this.store === undefined) return undefined;
    const started = process.hrtime.bigint();
    // And its CPU time: what the restore costs, whatever else the machine runs meanwhile.
    const cpu = process.cpuUsage();
    const restored = await restoreParked({ ...deps, client: this.store, peers: sessionPeers(deps.sessions), log: this.log }, this.inherited, this.slot);
    this.inherited = new Map();
    const last = restored.sessions.reduce((max, session) => (BigInt(session.id) > max ? BigInt(session.id) : max), 0n);
    deps.sessions.skipIdsThrough(last);
    this.log.info(
      {
        allocations: restored.allocations,
        stores: restored.stores,
        sessions: restored.sessions.length,
        dropped: restored.dropped,
        ms: Number(process.hrtime.bigint() - started) / 1e6,
        cpuMs: cpuMs(process.cpuUsage(cpu)),
      },
      restored.allocations + restored.stores > 0 ? 'parked memory taken back' : 'parking memory in the file-descriptor store',
    );
    // Each session is parked as it opens, and its record dropped once it has ended.
    deps.sessions.setJournal({ opened: (session) => this.slot.parking?.sessionOpened(session.id), ended: (id) => this.slot.parking?.sessionEnded(id) });
    // A session whose record has its tokens waits for its client to resume it; the others' objects are reclaimed after the grace.
    const resumable = restored.sessions.filter((session) => session.token !== undefined && session.resumeToken !== undefined);
    deps.sessions.awaitResume(
      resumable.map((session) => ({ id: BigInt(session.id), uid: session.uid, gid: session.gid, token: session.token!, resumeToken: session.resumeToken! })),
      graceMs,
    );
    const unresumable = { ...restored, sessions: restored.sessions.filter((session) => !resumable.includes(session)) };
    if (unresumable.sessions.length > 0) {
      this.grace = setTimeout(() => void this.reclaimParked(deps, unresumable), graceMs);
      this.grace.unref();
    }
    return restored;
  }

  /** Stops recording: what the stop reclaims next stays parked for the next start. */
  freeze(): void {
    if (this.grace !== undefined) clearTimeout(this.grace);
    this.slot.parking?.freeze();
  }

  /** Records again after a freeze whose successor never came: the parked state is this process's again. */
  thaw(): void {
    this.slot.parking?.thaw();
  }

  private async reclaimParked(deps: { registry: Registry; stores: StoreRegistry; sessions: SessionManager }, restored: Restored): Promise<void> {
    for (const parked of restored.sessions) {
      const id = BigInt(parked.id);
      if (deps.sessions.peerOf(id) !== undefined) continue;
      try {
        await deps.stores.reclaim(id);
        await deps.registry.reclaim(id);
      } catch (error) {
        this.log.error({ err: error, session: parked.id }, "reclaiming a parked session's objects failed");
      }
    }
  }
}

/** Who a session is, and its tokens, for its parked record: live sessions' and those still waiting to be resumed. */
function sessionPeers(sessions: SessionManager): SessionPeers {
  return {
    peerOf: (session) => sessions.peerOf(session),
    tokensOf: (session) => {
      const record = sessions.recordOf(session);
      return record === undefined ? undefined : { token: record.token, resumeToken: record.resumeToken };
    },
  };
}

const cpuMs = (usage: NodeJS.CpuUsage) => (usage.user + usage.system) / 1000;
