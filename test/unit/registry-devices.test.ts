/** Memory of several devices: copies go through the device that owns each part. */
import { Registry } from '../../server/registry';
import { FakeBackend, GRANULARITY } from './fake-backend';

class DeviceSpy extends FakeBackend {
  readonly copies: string[] = [];
  override async readBytes(address: bigint, length: number, device: number, into?: Buffer): Promise<Buffer> {
    this.copies.push(`read ${length} via ${device}`);
    return super.readBytes(address, length, device, into);
  }
  override async writeBytes(address: bigint, data: Buffer, device: number): Promise<void> {
    this.copies.push(`write ${data.length} via ${device}`);
    return super.writeBytes(address, data);
  }
}

it('splits a read and a write that span two devices into one copy per device', async () => {
  const backend = new DeviceSpy({ devices: 2, capacity: 64n << 20n });
  const registry = new Registry(backend);
  const reservation = registry.reserve(1n, { size: 3n * GRANULARITY, alignment: 0n, address: 0n });
  const placements = [0, 0, 1];
  for (const [index, device] of placements.entries()) {
    const allocation = await registry.create(1n, { size: GRANULARITY, location: { type: 'DEVICE', id: device }, handleType: 'POSIX_FD' });
    await registry.map(1n, { address: reservation.address + BigInt(index) * GRANULARITY, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
    await registry.setAccess(1n, reservation.address + BigInt(index) * GRANULARITY, GRANULARITY, [{ location: { type: 'DEVICE', id: device }, access: 3 }]);
  }
  const start = reservation.address + GRANULARITY + GRANULARITY / 2n;
  const data = Buffer.alloc(Number(GRANULARITY), 7);
  await registry.write(1n, start, data);
  const chunks: Buffer[] = [];
  for await (const chunk of registry.read(1n, reservation.address, 3n * GRANULARITY)) chunks.push(chunk.data);
  const all = Buffer.concat(chunks);
  expect(all.subarray(Number(start - reservation.address), Number(start - reservation.address) + data.length).equals(data)).toBe(true);
  const half = Number(GRANULARITY / 2n);
  expect(backend.copies.slice(0, 2)).toEqual([`write ${half} via 0`, `write ${half} via 1`]);
  expect(backend.copies).toContain(`read ${1 << 20} via 1`);
});
