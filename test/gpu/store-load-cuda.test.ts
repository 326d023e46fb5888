/**
 * Store load and dump and staged Read/Write through page-locked memory on the
 * cuda backend: vmmctl's pinned pipeline (client/pinned-copy.ts)
 * and the daemon's page-locked staging buffers (server/stores/staging.ts) move every
 * byte to its place, whatever the size's remainder, and the bytes read back
 * are the ones written.
 */
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect, VmmdClient } from '../../client';
import { MiB, packageRoot, TestDaemon } from '../e2e/harness';
import { describeGpu } from './gpu';

describeGpu('pinned copies on the cuda backend', () => {
  let daemon: TestDaemon;
  let client: VmmdClient;
  let dir: string;
  const ctl = (args: string[]) =>
    execFileSync(process.execPath, [path.join(packageRoot(), 'bin', 'vmmctl.js'), '--socket-dir', daemon.dir, ...args], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });

  beforeAll(async () => {
    daemon = await TestDaemon.start([], 'cuda');
    client = await connect({ socketDir: daemon.dir });
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-pinned-cuda-'));
  });

  afterAll(async () => {
    client.close();
    fs.rmSync(dir, { recursive: true, force: true });
    expect(await daemon.stop()).toBe(0);
  });

  it('vmmctl store load and dump move every byte, through page-locked buffers, several chunks at once', () => {
    for (const size of [Number(100n * MiB) + 12345, 4096, Number(32n * MiB)]) {
      const data = randomBytes(size);
      const file = path.join(dir, `in-${size}.bin`);
      const out = path.join(dir, `out-${size}.bin`);
      fs.writeFileSync(file, data);
      expect(ctl(['store', 'load', `pinned-${size}`, file])).toMatch(/^loaded /);
      expect(ctl(['store', 'dump', `pinned-${size}`, out])).toMatch(/^dumped /);
      expect(fs.readFileSync(out).equals(data)).toBe(true);
      // Standard output too: the dump writes in order.
      const piped = execFileSync(
        process.execPath,
        [path.join(packageRoot(), 'bin', 'vmmctl.js'), '--socket-dir', daemon.dir, 'store', 'dump', `pinned-${size}`, '-'],
        {
          maxBuffer: size + 1024,
          stdio: ['ignore', 'pipe', 'pipe'],
        },
      );
      expect(piped.equals(data)).toBe(true);
      ctl(['store', 'rm', `pinned-${size}`]);
    }
  });

  it('staged Read and Write of 256 MiB through the page-locked staging buffer land whole, at any offset', async () => {
    const size = 256n * MiB;
    const reservation = await client.vmm.reserve({ size });
    const allocation = await client.vmm.create({ size });
    await client.vmm.map({ address: reservation.address, size, allocationId: allocation.id });
    await client.vmm.setAccess({
      address: reservation.address,
      size,
      descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }],
    });
    try {
      const data = randomBytes(Number(size));
      await client.vmm.write(reservation.address, data);
      const back = Buffer.alloc(Number(size));
      await client.vmm.readInto(reservation.address, back);
      expect(back.equals(data)).toBe(true);
      // An unaligned piece in the middle, written and read back.
      const piece = randomBytes(Number(3n * MiB) + 7);
      const at = BigInt(reservation.address) + 5n * MiB + 3n;
      await client.vmm.write(at, piece);
      expect((await client.vmm.read(at, piece.length)).equals(piece)).toBe(true);
    } finally {
      await client.vmm.unmap({ address: reservation.address, size });
      await client.vmm.freeAddress({ address: reservation.address, size });
      await client.vmm.release({ allocationId: allocation.id });
    }
  });

  it('a staging buffer above the page-locking limit still works, unpinned', async () => {
    const big = await connect({ socketDir: daemon.dir, stagingBytes: 512 << 20 });
    try {
      const size = 64n * MiB;
      const allocation = await big.vmm.create({ size });
      const reservation = await big.vmm.reserve({ size });
      await big.vmm.map({ address: reservation.address, size, allocationId: allocation.id });
      await big.vmm.setAccess({
        address: reservation.address,
        size,
        descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }],
      });
      const data = randomBytes(Number(size));
      await big.vmm.write(reservation.address, data);
      expect((await big.vmm.read(reservation.address, size)).equals(data)).toBe(true);
    } finally {
      big.close();
    }
  });
});
