/**
 * Host mappings in the address arena, for real: memfds mapped side by side in
 * one PROT_NONE reservation, an unmap that leaves its neighbours' pages and
 * copies alone, the range reused, the reservation freed once empty.
 */
import * as fs from 'node:fs';
import { addon } from '../../native';
import { addressArenaStats, HostMapping, trimAddressArenas } from '../../native/mapping';

const MiB = 1024n * 1024n;
const SIZE = 64n * MiB;

/** Whether any mapping of this process covers `address` (/proc/self/maps). */
function mappedAt(address: bigint): boolean {
  return fs
    .readFileSync('/proc/self/maps', 'utf8')
    .split('\n')
    .filter(Boolean)
    .some((line) => {
      const [start, end] = line
        .split(' ')[0]
        .split('-')
        .map((hex) => BigInt(`0x${hex}`));
      return address >= start && address < end;
    });
}

describe('host mappings in the address arena', () => {
  const fds: number[] = [];
  const memfd = () => {
    const fd = addon.hostMemfdCreate('arena-test', SIZE);
    fds.push(fd);
    return fd;
  };

  afterEach(() => {
    for (const fd of fds.splice(0)) addon.close(fd);
    trimAddressArenas();
  });

  it('maps memfds side by side in one reservation and frees it once empty', () => {
    const before = addressArenaStats().host?.reservations ?? 0;
    const a = HostMapping.map(memfd(), SIZE, 2n * MiB, false);
    const b = HostMapping.map(memfd(), SIZE, 2n * MiB, false);
    expect(b.address).toBe(a.address + SIZE);
    expect(addressArenaStats().host.reservations).toBe(Math.max(before, 1));
    a.unmap();
    b.unmap();
    expect(trimAddressArenas()).toBeGreaterThanOrEqual(1);
    expect(addressArenaStats().host.reservations).toBe(0);
    expect(mappedAt(a.address)).toBe(false);
  });

  it('memory freed while a copy into its neighbour is in flight: the copy lands whole, the freed range is reused', async () => {
    const aFd = memfd();
    const a = HostMapping.map(aFd, SIZE, 2n * MiB, false);
    const b = HostMapping.map(memfd(), SIZE, 2n * MiB, false);
    await addon.hostCopyToAddress(a.address, Buffer.alloc(16, 0xaa));
    const bytes = Buffer.alloc(Number(SIZE), 0xb7);
    // A 64 MiB copy on a worker thread, into b, running while a is unmapped and its range mapped again.
    const write = addon.hostCopyToAddress(b.address, bytes);
    a.unmap();
    // The range is back in the reservation (PROT_NONE, not given to the kernel) and the next mapping takes it.
    expect(mappedAt(a.address)).toBe(true);
    const c = HostMapping.map(memfd(), SIZE, 2n * MiB, false);
    expect(c.address).toBe(a.address);
    await addon.hostCopyToAddress(c.address, Buffer.from('c'));
    await write;
    expect((await addon.hostCopyFromAddress(b.address, Number(SIZE))).equals(bytes)).toBe(true);
    // c has its own memfd's pages, not a's: a's bytes stayed in a's memfd.
    expect((await addon.hostCopyFromAddress(c.address, 2)).equals(Buffer.from([0x63, 0]))).toBe(true);
    const again = HostMapping.map(aFd, SIZE, 2n * MiB, true);
    expect((await addon.hostCopyFromAddress(again.address, 16)).equals(Buffer.alloc(16, 0xaa))).toBe(true);
    for (const mapping of [b, c, again]) mapping.unmap();
  });

  it('a mapping that fails gives its range back: a read-write map of a sealed memfd', () => {
    const fd = memfd();
    addon.hostMemfdSealReadOnly(fd);
    const a = HostMapping.map(memfd(), SIZE, 2n * MiB, false);
    const taken = addressArenaStats().host.takenBytes;
    expect(() => HostMapping.map(fd, SIZE, 2n * MiB, false)).toThrow(/EACCES|EPERM/);
    expect(addressArenaStats().host.takenBytes).toBe(taken);
    const b = HostMapping.map(fd, SIZE, 2n * MiB, true);
    expect(b.address).toBe(a.address + SIZE);
    a.unmap();
    b.unmap();
  });
});
