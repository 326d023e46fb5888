/** The addon's host memory mechanism, for real: memfds, reservations, seals. */
import { addon, HOST_ACCESS, isNativeError } from '../../native';

const MiB = 1n << 20n;
const SIZE = 2n * MiB;

function mapped(fd: number, access: number) {
  const address = addon.hostReserve(SIZE, SIZE, 0n);
  addon.hostMap(address, SIZE, fd, 0n);
  addon.hostProtect(address, SIZE, access);
  return address;
}

function release(address: bigint) {
  addon.hostUnmap(address, SIZE);
  addon.hostFreeAddress(address, SIZE);
}

describe('host memory', () => {
  it('reserves aligned address space', () => {
    const address = addon.hostReserve(SIZE, 64n * MiB, 0n);
    expect(address % (64n * MiB)).toBe(0n);
    addon.hostFreeAddress(address, SIZE);
  });

  it('shares pages between two mappings of one memfd, and an exported dup', async () => {
    const fd = addon.hostMemfdCreate('test', SIZE);
    const exported = addon.dup(fd);
    const first = mapped(fd, HOST_ACCESS.READWRITE);
    const second = mapped(exported, HOST_ACCESS.READ);
    await addon.hostCopyToAddress(first + 100n, Buffer.from('shared'));
    expect((await addon.hostCopyFromAddress(second + 100n, 6)).toString()).toBe('shared');
    const view = addon.hostArrayBuffer(second, Number(SIZE));
    expect(Buffer.from(view, 100, 6).toString()).toBe('shared');
    addon.hostDetachArrayBuffer(view);
    expect(view.byteLength).toBe(0);
    release(first);
    release(second);
    addon.close(fd);
    addon.close(exported);
  });

  it('keeps memory alive through a mapping after every descriptor is closed', async () => {
    const fd = addon.hostMemfdCreate('test', SIZE);
    const address = mapped(fd, HOST_ACCESS.READWRITE);
    addon.close(fd);
    await addon.hostCopyToAddress(address, Buffer.from('alive'));
    expect((await addon.hostCopyFromAddress(address, 5)).toString()).toBe('alive');
    release(address);
  });

  it('refuses writable mappings of a memfd sealed read-only, and keeps reads working', async () => {
    const fd = addon.hostMemfdCreate('test', SIZE);
    const writer = mapped(fd, HOST_ACCESS.READWRITE);
    await addon.hostCopyToAddress(writer, Buffer.from('frozen'));
    addon.hostMemfdSealReadOnly(fd);
    expect(addon.hostFdInfo(fd).readOnlySealed).toBe(true);
    const reader = addon.hostReserve(SIZE, SIZE, 0n);
    addon.hostMap(reader, SIZE, fd, 0n);
    addon.hostProtect(reader, SIZE, HOST_ACCESS.READ);
    expect((await addon.hostCopyFromAddress(reader, 6)).toString()).toBe('frozen');
    let refused: unknown;
    try {
      addon.hostProtect(reader, SIZE, HOST_ACCESS.READWRITE);
    } catch (error) {
      refused = error;
    }
    expect(isNativeError(refused)).toBe(true);
    expect(['EACCES', 'EPERM']).toContain((refused as { code: string }).code);
    release(reader);
    release(writer);
    addon.close(fd);
  });

  it('describes descriptors: memfd or not', () => {
    const fd = addon.hostMemfdCreate('test', SIZE);
    expect(addon.hostFdInfo(fd)).toMatchObject({ size: SIZE, memfd: true, regular: true });
    addon.close(fd);
  });

  it('throws errors with a string code and the errno apart', () => {
    let caught: unknown;
    try {
      addon.close(123456);
    } catch (error) {
      caught = error;
    }
    expect(caught).toMatchObject({ code: 'EBADF', errno: 9 });
    expect((caught as Error).message).toMatch(/^EBADF: close\(123456\)/);
  });
});
