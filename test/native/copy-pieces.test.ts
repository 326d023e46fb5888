/**
 * The addon's copies by address (hostCopyPieces): sleep and wake copy memory
 * of any size without a Buffer holding it; every piece lands where it should,
 * and bad arguments are refused before anything is copied.
 */
import { addon } from '../../native';
import { copyPieces, dealPieces } from '../../client/offload-copy';

describe('hostCopyPieces', () => {
  test('copies pieces of odd sizes by address, over two lanes at once, byte for byte', async () => {
    const source = Buffer.alloc(1 << 20);
    for (let i = 0; i < source.length; i++) source[i] = (i * 7 + 3) & 0xff;
    const target = Buffer.alloc(source.length);
    const pieces = copyPieces([{ target: addon.addressOf(target), source: addon.addressOf(source), length: BigInt(source.length) }], 4099n);
    await Promise.all(dealPieces(pieces, 2).map((lane) => addon.hostCopyPieces(lane)));
    expect(target.equals(source)).toBe(true);
  });

  test('refuses what is not (target, source, length) triples in a BigUint64Array', () => {
    expect(() => addon.hostCopyPieces(new BigUint64Array(2))).toThrow(/triples/);
    expect(() => addon.hostCopyPieces([1n, 2n, 3n] as unknown as BigUint64Array)).toThrow(/BigUint64Array/);
  });
});

describe('hostPopulate', () => {
  test('faults a memfd mapping in without changing a byte, and refuses an address that is not mapped', async () => {
    const size = 4n << 20n;
    const fd = addon.hostMemfdCreate('populate', size);
    const address = addon.hostReserve(size, size, 0n);
    try {
      addon.hostMap(address, size, fd, 0n);
      addon.hostProtect(address, size, 3);
      const view = new Uint8Array(addon.hostArrayBuffer(address, Number(size)));
      view[12345] = 7;
      await addon.hostPopulate(address, size);
      expect(view[12345]).toBe(7);
      expect(view.reduce((sum, byte) => sum + byte, 0)).toBe(7);
      addon.hostDetachArrayBuffer(view.buffer as ArrayBuffer);
    } finally {
      addon.hostUnmap(address, size);
      addon.hostFreeAddress(address, size);
      addon.close(fd);
    }
    const unmapped = addon.hostReserve(size, size, 0n);
    try {
      await expect(addon.hostPopulate(unmapped, size)).rejects.toThrow(/MADV_POPULATE_WRITE/);
    } finally {
      addon.hostFreeAddress(unmapped, size);
    }
  });
});
