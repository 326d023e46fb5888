/**
 * Wraps any backend, records every call that changes state, and counts what is
 * live (handles, mappings, reservations), so contract tests can assert that a
 * refused request reached no backend and that memory was freed, on the fake,
 * host and cuda backends alike.
 */
import { Backend, BackendHandle, HandleKind, ImportSource, MemLocation } from '../../server/backends/backend';

export class RecordingBackend implements Backend {
  readonly calls: string[] = [];
  liveHandles = 0;
  /** The most handles live at once since the backend was made (creates count as they land, releases once done). */
  maxLiveHandles = 0;
  liveMappings = 0;
  liveReservations = 0;
  /** Driver references retained (RetainHandle) and not yet dropped, by handle. */
  readonly liveRetains = new Map<BackendHandle, number>();
  /** While set, unmaps wait for it: tests use it to hold an unmap in flight. */
  unmapGate?: Promise<void>;
  /** While set, writes wait for it before their copy: tests use it to hold a copy in flight. */
  writeGate?: Promise<void>;
  /** While set, creates wait for it once the backend has made their memory: tests use it to hold creates in flight. */
  createGate?: Promise<void>;
  /** While set, releases wait for it before freeing: tests use it to hold a free in flight. */
  releaseGate?: Promise<void>;
  /** While set, drops of retained references wait for it: tests use it to hold one in flight. */
  releaseReferenceGate?: Promise<void>;
  // Drops of retained references in flight, by handle: one more than is retained is refused while they run.
  private readonly retainDrops = new Map<BackendHandle, number>();
  /** Creates started and not yet settled. */
  createsInFlight = 0;
  /** Calls to fail, with their error and how many more times (as an injected driver fault would). */
  private readonly failures = new Map<string, { error: Error; times: number }>();

  constructor(readonly inner: Backend) {}

  /** The next call named (the next `times` calls) fails with `error` before reaching the backend. */
  failOnce(call: 'release' | 'releaseReference' | 'unmap' | 'freeAddress', error: Error, times = 1): void {
    this.failures.set(call, { error, times });
  }

  private record(call: string): void {
    this.calls.push(call);
    const failure = this.failures.get(call);
    if (failure !== undefined) {
      if (--failure.times === 0) this.failures.delete(call);
      throw failure.error;
    }
  }

  get name() {
    return this.inner.name;
  }

  get capabilities() {
    return this.inner.capabilities;
  }

  devices() {
    return this.inner.devices();
  }

  memoryInfo(device: number) {
    return this.inner.memoryInfo(device);
  }

  granularity(location: MemLocation) {
    return this.inner.granularity(location);
  }

  canAccessPeer(device: number, owner: number) {
    return this.inner.canAccessPeer(device, owner);
  }

  reserve(size: bigint, alignment: bigint, hint: bigint) {
    this.calls.push('reserve');
    const address = this.inner.reserve(size, alignment, hint);
    this.liveReservations++;
    return address;
  }

  freeAddress(address: bigint, size: bigint) {
    this.record('freeAddress');
    this.inner.freeAddress(address, size);
    this.liveReservations--;
  }

  async create(device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]) {
    this.calls.push('create');
    this.createsInFlight++;
    try {
      const handle = await this.inner.create(device, location, size, handleTypes);
      this.maxLiveHandles = Math.max(this.maxLiveHandles, ++this.liveHandles);
      if (this.createGate) await this.createGate;
      return handle;
    } finally {
      this.createsInFlight--;
    }
  }

  async release(...args: Parameters<Backend['release']>) {
    this.record('release');
    if (this.releaseGate) await this.releaseGate;
    await this.inner.release(...args);
    this.liveHandles--;
  }

  retainHandle(address: bigint, handle: BackendHandle) {
    this.calls.push('retainHandle');
    const retained = this.inner.retainHandle(address, handle);
    this.liveRetains.set(retained, (this.liveRetains.get(retained) ?? 0) + 1);
    return retained;
  }

  async releaseReference(...args: Parameters<Backend['releaseReference']>) {
    this.record('releaseReference');
    // One more than was retained would be the creator's own reference: the driver would free the memory under its holders.
    const retains = this.liveRetains.get(args[0]) ?? 0;
    const inFlight = this.retainDrops.get(args[0]) ?? 0;
    if (retains - inFlight <= 0)
      throw new Error(
        `releaseReference of handle ${args[0]}, which holds no retained reference not already being dropped: the memory would be freed under its holders`,
      );
    this.retainDrops.set(args[0], inFlight + 1);
    try {
      if (this.releaseReferenceGate) await this.releaseReferenceGate;
      await this.inner.releaseReference(...args);
    } finally {
      const still = (this.retainDrops.get(args[0]) ?? 1) - 1;
      if (still === 0) this.retainDrops.delete(args[0]);
      else this.retainDrops.set(args[0], still);
    }
    // Counted down once the driver dropped it: a failed drop keeps it.
    const left = (this.liveRetains.get(args[0]) ?? 0) - 1;
    if (left <= 0) this.liveRetains.delete(args[0]);
    else this.liveRetains.set(args[0], left);
  }

  async map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint) {
    this.calls.push('map');
    await this.inner.map(address, size, handle, offset);
    this.liveMappings++;
  }

  async unmap(...args: Parameters<Backend['unmap']>) {
    this.record('unmap');
    if (this.unmapGate) await this.unmapGate;
    await this.inner.unmap(...args);
    this.liveMappings--;
  }

  async setAccess(...args: Parameters<Backend['setAccess']>) {
    this.calls.push('setAccess');
    await this.inner.setAccess(...args);
  }

  exportHandle(...args: Parameters<Backend['exportHandle']>) {
    this.calls.push('export');
    return this.inner.exportHandle(...args);
  }

  sealReadOnly(handle: BackendHandle) {
    this.calls.push('seal');
    this.inner.sealReadOnly(handle);
  }

  memoryIdentity(...args: Parameters<Backend['memoryIdentity']>) {
    return this.inner.memoryIdentity(...args);
  }

  holdClientMemfd(...args: Parameters<Backend['holdClientMemfd']>) {
    return this.inner.holdClientMemfd(...args);
  }

  dropClientMemfd(...args: Parameters<Backend['dropClientMemfd']>) {
    this.inner.dropClientMemfd(...args);
  }

  exportFabric(...args: Parameters<Backend['exportFabric']>) {
    this.calls.push('exportFabric');
    return this.inner.exportFabric(...args);
  }

  async importHandle(source: ImportSource, size: bigint) {
    this.calls.push('import');
    const imported = await this.inner.importHandle(source, size);
    this.maxLiveHandles = Math.max(this.maxLiveHandles, ++this.liveHandles);
    return imported;
  }

  async createExported(device: number, location: MemLocation, size: bigint) {
    this.calls.push('createExported');
    const made = await this.inner.createExported(device, location, size);
    this.maxLiveHandles = Math.max(this.maxLiveHandles, ++this.liveHandles);
    return made;
  }

  readBytes(address: bigint, length: number, device: number, into?: Buffer) {
    this.calls.push('read');
    return this.inner.readBytes(address, length, device, into);
  }

  async writeBytes(address: bigint, data: Buffer, device: number) {
    this.calls.push('write');
    if (this.writeGate) await this.writeGate;
    await this.inner.writeBytes(address, data, device);
    this.calls.push('write landed');
  }

  close() {
    return this.inner.close();
  }
}
