/**
 * A staging buffer's size is counted against its holder's budget before the
 * daemon maps it, and given back exactly once when the buffer goes: mapping
 * failed, replaced by another, closed with its session. A refused charge maps
 * nothing and closes the descriptor.
 */
import { status as Status } from '@grpc/grpc-js';
import { addon } from '../../native';
import { Budget } from '../../server/registry/budgets';
import { takeAmountOnce } from '../../server/transport/budgets';
import { StagingBuffers } from '../../server/stores/staging';

const SESSION = 9n;
const UID = 1000;
const MiB = 1 << 20;

function setUp(limit: number): { staging: StagingBuffers; budget: Budget; charge: (size: bigint) => () => void } {
  const budget = new Budget('staging bytes per uid', limit, ' bytes');
  return { staging: new StagingBuffers(), budget, charge: (size) => takeAmountOnce(budget, UID, Number(size)) };
}

describe('a staging buffer and its budget', () => {
  afterEach(() => addon.faultsSet(''));

  it('is refused BUDGET_EXCEEDED before it is mapped, and its descriptor closed', async () => {
    const { staging, budget, charge } = setUp(MiB);
    const fd = addon.hostMemfdCreate('staging', 2n * BigInt(MiB));
    await expect(staging.open(SESSION, fd, charge)).rejects.toMatchObject({
      status: Status.RESOURCE_EXHAUSTED,
      code: 'BUDGET_EXCEEDED',
      message: `staging bytes per uid: uid ${UID} holds 0 bytes of at most ${MiB} bytes; this request needs ${2 * MiB} bytes more`,
    });
    expect(() => addon.hostFdInfo(fd)).toThrow();
    expect(budget.usedBy(UID)).toBe(0);
    await expect(staging.use(SESSION, 0n, 1n, async () => undefined)).rejects.toMatchObject({ code: 'NO_STAGING' });
  });

  it('gives the size back when the mapping fails, when the buffer is replaced and when it is closed', async () => {
    const { staging, budget, charge } = setUp(4 * MiB);
    addon.faultsSet('mmap:map:1:ENOMEM');
    await expect(staging.open(SESSION, addon.hostMemfdCreate('staging', BigInt(MiB)), charge)).rejects.toMatchObject({ code: 'DAEMON_MAP_FAILED' });
    addon.faultsSet('');
    expect(budget.usedBy(UID)).toBe(0);
    await staging.open(SESSION, addon.hostMemfdCreate('staging', BigInt(MiB)), charge);
    expect(budget.usedBy(UID)).toBe(MiB);
    await staging.open(SESSION, addon.hostMemfdCreate('staging', 2n * BigInt(MiB)), charge);
    expect(budget.usedBy(UID)).toBe(2 * MiB);
    await staging.close(SESSION);
    expect(budget.usedBy(UID)).toBe(0);
    await staging.close(SESSION);
    expect(budget.usedBy(UID)).toBe(0);
  });
});
