/**
 * Which peer devices a CUDA mapping of this process opens to: those that can
 * reach its device (cuDeviceCanAccessPeer) and that this process maps memory
 * on too. A device's first mapping opens the mappings made before it to that
 * device, as cuMemAlloc memory opens to the peers that enabled peer access:
 * code written for it copies between two devices' buffers, and a process that
 * maps on one device never pays for a peer's page tables (each map and unmap
 * cost about a millisecond more on two H200s when every mapping opened to
 * every peer). Used by native/mapping.ts.
 */
import { addon, CU_LOCATION } from './index';

// The devices that can reach each device's memory as a peer (cuDeviceCanAccessPeer), asked once per device.
const peerCache = new Map<number, number[]>();
// Devices this process maps memory on (counted when their first mapping starts).
const usedDevices = new Set<number>();
// Invariant: the PeerAccess of every mapping whose memory is mapped with its access set, and not yet closed.
const openMappings = new Set<PeerAccess>();
// A device's first mapping opening the others to it: later mappings of that device wait for it.
const joining = new Map<number, Promise<void>>();

/** The other devices that can access `device`'s memory. */
function peersOf(device: number): number[] {
  let peers = peerCache.get(device);
  if (peers === undefined) {
    peers = [];
    const count = addon.cudaDevices().length;
    for (let other = 0; other < count; other++) if (other !== device && addon.cudaCanAccessPeer(other, device)) peers.push(other);
    peerCache.set(device, peers);
  }
  return peers;
}

/** The peers of `device` this process maps on: a new mapping of `device` opens to them. */
export function usedPeers(device: number): number[] {
  return peersOf(device).filter((peer) => usedDevices.has(peer));
}

/**
 * Resolves once `device` counts as used and every open mapping it can reach
 * is open to it; a mapping of `device` waits for this before it starts.
 * @throws the addon's error of a grant (`device` is not counted: its next mapping tries again)
 */
export function join(device: number): Promise<void> {
  if (usedDevices.has(device) && !joining.has(device)) return Promise.resolve();
  let pending = joining.get(device);
  if (pending === undefined) {
    pending = openAllTo(device).finally(() => joining.delete(device));
    joining.set(device, pending);
  }
  return pending;
}

async function openAllTo(device: number): Promise<void> {
  // Counted first: a mapping that registers from here on opens itself to it (PeerAccess.register).
  usedDevices.add(device);
  try {
    // Each one only while still open (openTo checks): one closed meanwhile may have left its range to another mapping.
    for (const mapping of [...openMappings]) {
      if (mapping.device !== device && peersOf(mapping.device).includes(device)) await mapping.openTo([device]);
    }
  } catch (error) {
    usedDevices.delete(device);
    throw error;
  }
}

/** The peer devices one mapping is open to, and its grants. */
export class PeerAccess {
  // The peer devices the mapping is open to, besides its own.
  private readonly peers = new Set<number>();
  // The grants started on the mapping, one after another, and how many have not settled; a close waits for them
  // (its range may be handed out next).
  private granting: Promise<void> = Promise.resolve();
  private unsettled = 0;

  /** @param flags the mapping's access (1 read, 3 read and write), given to its peers too */
  constructor(
    readonly device: number,
    private readonly address: bigint,
    private readonly size: bigint,
    public flags: 1 | 3,
  ) {}

  /**
   * The mapping is open, to its device and `granted`: a device joining from
   * now on opens it, and so does this, for those that joined after `granted`
   * was chosen.
   * @throws the addon's error; the mapping stays open
   */
  async register(granted: number[]): Promise<void> {
    for (const peer of granted) this.peers.add(peer);
    openMappings.add(this);
    await this.openTo(usedPeers(this.device));
  }

  /**
   * Opens the mapping to those of `devices` it is not open to, with its own
   * access, after the grants already started on it; nothing once it is closed
   * (its range may be another mapping's by then).
   * @throws the addon's error, while the mapping is open
   */
  openTo(devices: number[]): Promise<void> {
    const grant = this.granting.then(async () => {
      const wanted = devices.filter((id) => !this.peers.has(id));
      if (!openMappings.has(this) || wanted.length === 0) return;
      try {
        await addon.cudaSetAccess(
          this.address,
          this.size,
          wanted.map((id) => ({ type: CU_LOCATION.DEVICE, id, flags: this.flags })),
        );
      } catch (error) {
        if (openMappings.has(this)) throw error;
        return;
      }
      for (const id of wanted) this.peers.add(id);
    });
    this.unsettled++;
    this.granting = grant.catch(() => undefined).finally(() => this.unsettled--);
    return grant;
  }

  /**
   * Before an unmap: no grant starts on the mapping any more; undefined when
   * none is under way (the unmap starts in this turn, as without peers), else
   * resolves once those started have settled.
   */
  close(): Promise<void> | undefined {
    openMappings.delete(this);
    return this.unsettled > 0 ? this.granting : undefined;
  }

  /** After an unmap that failed (the memory is still there): open again, to the peers used by now, as far as it goes. */
  async reopen(): Promise<void> {
    openMappings.add(this);
    await this.openTo(usedPeers(this.device)).catch(() => undefined);
  }

  /** After an unmap: the memory is gone, and with it every grant. */
  forget(): void {
    this.peers.clear();
  }
}
