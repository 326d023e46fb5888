/**
 * A client's mappings on two devices reach each other once the process maps
 * on both, whichever came first: a mapping on device 0 made before the
 * process's first mapping on device 1 is opened to device 1 then, so device
 * 1 copies from it (and device 0 from device 1's), as code written for
 * cuMemAlloc with peer access expects. Needs two devices that reach each other.
 */
import { connect } from '../../client';
import { addon, CU_LOCATION } from '../../native';
import { MiB, TestDaemon } from '../e2e/harness';
import { cuda, describeGpu } from './gpu';

const twoPeers = cuda.loaded && cuda.deviceCount >= 2 && addon.cudaCanAccessPeer(1, 0) && addon.cudaCanAccessPeer(0, 1);

describeGpu('mappings on two devices of one process', () => {
  (twoPeers ? it : it.skip)("reach each other: device 1 copies from a mapping made before the process's first on device 1, and back", async () => {
    const daemon = await TestDaemon.start([], 'cuda');
    const client = await connect({ socketDir: daemon.dir });
    try {
      const size = 2n * MiB;
      const pattern = Buffer.alloc(Number(size), 0);
      for (let i = 0; i < pattern.length; i += 4096) pattern.write(`page ${i / 4096} of device 0`, i);
      const first = await client.vmm.allocate({ size, location: { type: 'LOCATION_TYPE_DEVICE', id: 0 } });
      await first.write(0, pattern);
      // Only device 0 used so far: device 1 has no access to it.
      expect(addon.cudaGetAccess(first.address, CU_LOCATION.DEVICE, 1)).toBe(0);
      const second = await client.vmm.allocate({ size, location: { type: 'LOCATION_TYPE_DEVICE', id: 1 } });
      expect(addon.cudaGetAccess(first.address, CU_LOCATION.DEVICE, 1)).toBe(3);
      expect(addon.cudaGetAccess(second.address, CU_LOCATION.DEVICE, 0)).toBe(3);
      await addon.cudaCopyPieces(1, BigUint64Array.from([second.address, first.address, size]), 1);
      expect((await second.read(0, size)).equals(pattern)).toBe(true);
      const third = await client.vmm.allocate({ size, location: { type: 'LOCATION_TYPE_DEVICE', id: 0 } });
      await addon.cudaCopyPieces(0, BigUint64Array.from([third.address, second.address, size]), 1);
      expect((await third.read(0, size)).equals(pattern)).toBe(true);
      for (const memory of [first, second, third]) await memory.close();
    } finally {
      client.close();
      expect(await daemon.stop()).toBe(0);
    }
  });
});
