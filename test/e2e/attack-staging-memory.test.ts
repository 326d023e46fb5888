/**
 * A staging buffer is a client's memfd the daemon maps and writes into
 * (ReadStaged): each page the daemon's copy touches first is allocated by
 * the daemon, in its resident set and its cgroup (the unit's MemoryMax), yet
 * no quota, capacity or budget counts it. A session that opens a large
 * buffer without touching it and has the daemon fill it from a small
 * allocation of its own makes the daemon hold that much memory. The staging
 * bytes budget bounds it: OpenStaging past the uid's budget is refused
 * before the daemon maps anything.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { call, MiB, stopWhenClean, TestDaemon } from './harness';

const QUOTA = 16n * MiB;
const STAGING = 128n * MiB;
/** The uid's staging budget in this test: below the buffer the attacker sends. */
const STAGING_BUDGET = 32n * MiB;
/** What else the daemon's shared memory may grow by meanwhile (the attacker's 2 MiB allocation, the quota's room). */
const MARGIN = QUOTA;
const SIZE = 2n * MiB;
const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];

afterEach(async () => {
  await stopWhenClean(daemon, clients);
  daemon = undefined;
});

/** The daemon's resident shared memory (memfd pages it maps), bytes. */
function residentShared(pid: number): bigint {
  const line = fs.readFileSync(`/proc/${pid}/status`, 'utf8').match(/^RssShmem:\s+(\d+) kB$/m);
  return BigInt(line![1]) * 1024n;
}

describe('staging buffers and the daemon memory', () => {
  it('a session cannot make the daemon hold more of its staging buffers than its staging budget', async () => {
    daemon = await TestDaemon.start(['--quota-per-uid', String(QUOTA), '--max-staging-bytes-per-uid', String(STAGING_BUDGET)]);
    const attacker = await connect({ socketDir: daemon.dir, stagingBytes: 0 } as never);
    clients.push(attacker);
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, attacker.session.token);
    const allocation = await attacker.vmm.create({ size: SIZE });
    const { address } = await attacker.vmm.reserve({ size: SIZE });
    await attacker.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    await attacker.vmm.setAccess({ address, size: SIZE, descriptors: RW });
    const before = residentShared(daemon.pid);
    // A buffer the client never touches: every page is first written by the daemon's copy.
    const fd = addon._memfdCreate('attack-staging-memory', STAGING, true);
    const refused = await call(daemon.raw.vmm, 'OpenStaging', { transferId: attacker.session.sendDescriptor(fd) }, metadata).then(
      () => undefined,
      (error: grpc.ServiceError) => error,
    );
    addon.close(fd);
    const opened = refused === undefined;
    expect(refused).toMatchObject({ code: grpc.status.RESOURCE_EXHAUSTED, details: expect.stringContaining('staging bytes per uid') });
    if (opened) {
      for (let offset = 0n; offset < STAGING; offset += SIZE) {
        await call(daemon.raw.vmm, 'ReadStaged', { address: String(address), length: String(SIZE), stagingOffset: String(offset) }, metadata).catch(
          () => undefined,
        );
      }
    }
    const grown = residentShared(daemon.pid) - before;
    await attacker.vmm.unmap({ address, size: SIZE });
    await attacker.vmm.freeAddress({ address, size: SIZE });
    await attacker.vmm.release({ allocationId: allocation.id });
    // In MiB: what the daemon holds, at most the uid's staging budget and a margin.
    expect(Number(grown / MiB)).toBeLessThanOrEqual(Number((STAGING_BUDGET + MARGIN) / MiB));
  });
});
