/**
 * The staging bytes budget: a uid's sessions may have the daemon map at most
 * --max-staging-bytes-per-uid of staging buffers at once (the pages the
 * daemon's staged copies touch are the daemon's memory). OpenStaging past it
 * is refused RESOURCE_EXHAUSTED BUDGET_EXCEEDED before anything is mapped; a
 * replaced or closed buffer gives its bytes back; metrics and GetReport show it; the TypeScript client whose
 * buffer is refused streams over gRPC instead, and its copies stay correct.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { call, freePort, MiB, scrapeMetrics, stopWhenClean, TestDaemon } from './harness';

const BUDGET = 8n * MiB;
const SIZE = 4n * MiB;
const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

let daemon: TestDaemon | undefined;
let metricsPort: number;
const clients: VmmdClient[] = [];

afterEach(async () => {
  await stopWhenClean(daemon, clients);
  daemon = undefined;
});

async function start(): Promise<TestDaemon> {
  metricsPort = await freePort();
  daemon = await TestDaemon.start(['--max-staging-bytes-per-uid', String(BUDGET), '--metrics-port', String(metricsPort)]);
  return daemon;
}

/** A client that opens staging buffers by hand, and its session's metadata. */
async function rawSession(): Promise<{ client: VmmdClient; metadata: grpc.Metadata }> {
  const client = await connect({ socketDir: daemon!.dir, stagingBytes: 0 } as never);
  clients.push(client);
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, client.session.token);
  return { client, metadata };
}

function openStaging(session: { client: VmmdClient; metadata: grpc.Metadata }, size: bigint): Promise<unknown> {
  const fd = addon._memfdCreate('staging-budget', size, true);
  return call(daemon!.raw.vmm, 'OpenStaging', { transferId: session.client.session.sendDescriptor(fd) }, session.metadata).finally(() => addon.close(fd));
}

const refusal = (used: bigint, amount: bigint) => ({
  code: grpc.status.RESOURCE_EXHAUSTED,
  details: expect.stringContaining(
    `staging bytes per uid: uid ${process.getuid!()} holds ${used} bytes of at most ${BUDGET} bytes; this request needs ${amount} bytes more`,
  ),
  metadata: expect.anything(),
});

const scrape = () => scrapeMetrics(metricsPort);

describe('the staging bytes budget', () => {
  it('refuses a buffer past the budget before mapping it, and gives bytes back on replace and on session end', async () => {
    await start();
    const first = await rawSession();
    const second = await rawSession();
    await expect(openStaging(first, 2n * BUDGET)).rejects.toMatchObject(refusal(0n, 2n * BUDGET));
    await openStaging(first, SIZE);
    // Replacing a buffer counts the new one while the old is still mapped, then gives the old back.
    await openStaging(first, SIZE);
    await openStaging(second, SIZE);
    await expect(openStaging(second, SIZE)).rejects.toMatchObject(refusal(BUDGET, SIZE));
    const during = await scrape();
    expect(during).toMatch(new RegExp(`^vmmd_budget_limit\\{budget="staging bytes per uid"\\} ${BUDGET}$`, 'm'));
    expect(during).toMatch(new RegExp(`^vmmd_budget_used\\{budget="staging bytes per uid",uid="${process.getuid!()}"\\} ${BUDGET}$`, 'm'));
    const report = JSON.parse((await call(daemon!.raw.admin, 'GetReport', {})).json);
    expect(report.budgets['staging bytes per uid']).toEqual({ limit: Number(BUDGET), used: { [process.getuid!()]: Number(BUDGET) } });
    // The first session's end gives its buffer back: a third session may open one.
    await first.client.close();
    const third = await rawSession();
    for (let tries = 0; ; tries++) {
      try {
        await openStaging(third, SIZE);
        break;
      } catch (error) {
        if (tries > 50) throw error;
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    }
  });

  it('a client whose staging buffer is refused reads and writes by streaming', async () => {
    await start();
    const hog = await rawSession();
    await openStaging(hog, BUDGET);
    const client = await connect({ socketDir: daemon!.dir, stagingBytes: Number(SIZE) });
    clients.push(client);
    const allocation = await client.vmm.create({ size: SIZE });
    const { address } = await client.vmm.reserve({ size: SIZE });
    await client.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    await client.vmm.setAccess({ address, size: SIZE, descriptors: RW });
    const data = Buffer.alloc(Number(SIZE));
    for (let i = 0; i < data.length; i += 4) data.writeUInt32LE(i, i);
    await expect(client.vmm.write(address, data)).resolves.toEqual({ bytesWritten: String(SIZE) });
    expect((await client.vmm.read(address, SIZE)).equals(data)).toBe(true);
    const into = Buffer.alloc(Number(SIZE));
    await client.vmm.readInto(address, into);
    expect(into.equals(data)).toBe(true);
    await client.vmm.unmap({ address, size: SIZE });
    await client.vmm.freeAddress({ address, size: SIZE });
    await client.vmm.release({ allocationId: allocation.id });
  });
});
