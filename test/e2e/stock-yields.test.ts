/**
 * Memory the daemon holds for speed (allocations stocked ahead, frees held
 * back until the daemon is quiet) yields to every request that needs memory,
 * as it yields to Create: an Import or a SYSMEM Attach of a client's memfd
 * that fits the host capacity once the stock is given back succeeds.
 */
import { connect, VmmdClient } from '../../client';
import { addon } from '../../native';
import { eventually, MiB, stopWhenClean, TestDaemon } from './harness';

const STOCKED = ['--host-capacity', '64MiB', '--stock', '2MiB:8'];
const LARGE = 56n * MiB;

let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];

afterEach(async () => {
  await stopWhenClean(daemon, clients);
  daemon = undefined;
});

async function client(): Promise<VmmdClient> {
  const connected = await connect({ socketDir: daemon!.dir });
  clients.push(connected);
  return connected;
}

/** Waits until the stock's one shelf is full again (8 of 2 MiB: 16 MiB of the 64). */
async function stockFull(c: VmmdClient): Promise<void> {
  await eventually(
    async () => {
      const report = (await c.admin.getReport()) as { stock: { levels: Array<{ held: number; depth: number }> } };
      const [level] = report.stock.levels;
      return level !== undefined && level.held === level.depth ? true : undefined;
    },
    10_000,
    'the stock to refill',
  );
}

describe('the stock and the held frees yield memory', () => {
  it('to Create, then to Import and to a SYSMEM Attach of a 56 MiB memfd beside a full stock', async () => {
    daemon = await TestDaemon.start(STOCKED);
    const c = await client();
    await stockFull(c);
    const created = await c.vmm.create({ size: LARGE });
    await c.vmm.release({ allocationId: created.id });
    await stockFull(c);
    const imported = addon._memfdCreate('large-import', LARGE, true);
    const allocation = await c.vmm.importDescriptor(imported, { size: LARGE });
    await c.vmm.release({ allocationId: allocation.id });
    addon.close(imported);
    await stockFull(c);
    const attached = addon._memfdCreate('large-attach', LARGE, true);
    const store = await c.stores.attachDescriptor(attached, { target: 'STORE_TARGET_SYSMEM', device: 0, size: LARGE, readOnly: false });
    await c.stores.detach(BigInt(store.id));
    addon.close(attached);
  });
});
