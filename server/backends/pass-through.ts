/**
 * A backend in front of another that passes every call through to it: the
 * base of a backend that adds a policy to a few calls (the stock,
 * server/backends/stock.ts) and overrides those.
 */
import type { AccessGrant, Backend, BackendHandle, DeviceInfo, HandleKind, ImportedHandle, ImportSource, MemLocation, MemoryInfo } from './backend';

export class PassThroughBackend implements Backend {
  constructor(protected readonly inner: Backend) {}

  get name() {
    return this.inner.name;
  }
  get capabilities() {
    return this.inner.capabilities;
  }
  create(device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    return this.inner.create(device, location, size, handleTypes);
  }
  exportHandle(handle: BackendHandle, device: number): Promise<number> {
    return this.inner.exportHandle(handle, device);
  }
  release(handle: BackendHandle, size: bigint, imported: boolean, device: number, awaited?: boolean): Promise<void> {
    return this.inner.release(handle, size, imported, device, awaited);
  }
  restoreHandle(fd: number, size: bigint): Promise<ImportedHandle> {
    if (this.inner.restoreHandle === undefined) throw new Error(`the ${this.inner.name} backend cannot take parked memory back`);
    return this.inner.restoreHandle(fd, size);
  }
  freezeSeals(handle: BackendHandle): void {
    this.inner.freezeSeals?.(handle);
  }
  settleReleases(): Promise<void> {
    return this.inner.settleReleases?.() ?? Promise.resolve();
  }
  close(): void | Promise<void> {
    return this.inner.close();
  }
  devices(): DeviceInfo[] {
    return this.inner.devices();
  }
  createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }> {
    return this.inner.createExported(device, location, size);
  }
  memoryInfo(device: number): MemoryInfo {
    return this.inner.memoryInfo(device);
  }
  granularity(location: MemLocation): { minimum: bigint; recommended: bigint } {
    return this.inner.granularity(location);
  }
  canAccessPeer(device: number, owner: number): boolean {
    return this.inner.canAccessPeer(device, owner);
  }
  reserve(size: bigint, alignment: bigint, hint: bigint): bigint {
    return this.inner.reserve(size, alignment, hint);
  }
  freeAddress(address: bigint, size: bigint): void {
    this.inner.freeAddress(address, size);
  }
  retainHandle(address: bigint, handle: BackendHandle): BackendHandle {
    return this.inner.retainHandle(address, handle);
  }
  releaseReference(handle: BackendHandle, device: number): Promise<void> {
    return this.inner.releaseReference(handle, device);
  }
  map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): Promise<void> {
    return this.inner.map(address, size, handle, offset);
  }
  unmap(address: bigint, size: bigint, device: number): Promise<void> {
    return this.inner.unmap(address, size, device);
  }
  setAccess(address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    return this.inner.setAccess(address, size, grants);
  }
  sealReadOnly(handle: BackendHandle): void {
    this.inner.sealReadOnly(handle);
  }
  memoryIdentity(handle: BackendHandle, device: number): string {
    return this.inner.memoryIdentity(handle, device);
  }
  holdClientMemfd(fd: number, size: bigint): Promise<string> {
    return this.inner.holdClientMemfd(fd, size);
  }
  dropClientMemfd(identity: string): void {
    this.inner.dropClientMemfd(identity);
  }
  exportFabric(handle: BackendHandle, device: number): Promise<Buffer> {
    return this.inner.exportFabric(handle, device);
  }
  importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    return this.inner.importHandle(source, size);
  }
  readBytes(address: bigint, length: number, device: number, into?: Buffer): Promise<Buffer> {
    return this.inner.readBytes(address, length, device, into);
  }
  writeBytes(address: bigint, data: Buffer, device: number): Promise<void> {
    return this.inner.writeBytes(address, data, device);
  }
}
