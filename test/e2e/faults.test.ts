/**
 * Injected faults on the host backend (test/contracts/faults.contract.ts: each
 * step of create/export/map/attach/detach and the frees failing in turn), and
 * the fault plan itself.
 */
import { addon } from '../../native';
import { faultsContract } from '../contracts/faults.contract';
import { TestDaemon } from './harness';

describe('an operation whose step fails (host)', () => {
  faultsContract('host');
});

describe('the fault plan', () => {
  afterEach(() => addon.faultsSet(''));

  it('fails exactly the N-th call of the function named, once, with the error named', () => {
    addon.faultsSet('dup:2:EMFILE');
    const fd = addon.hostMemfdCreate('faults', 4096n);
    try {
      addon.close(addon.dup(fd));
      expect(() => addon.dup(fd)).toThrow(expect.objectContaining({ code: 'EMFILE' }));
      addon.close(addon.dup(fd));
      expect(addon.faultsState()).toEqual({ active: true, calls: { memfd_create: 1, dup: 3 }, pending: [] });
    } finally {
      addon.close(fd);
    }
  });

  it.each([
    ['dup', /is not NAME:N:ERROR/],
    ['dup:0:EMFILE', /N must be a call number from 1/],
    ['dup:x:EMFILE', /N must be a call number/],
    ['dup:1:EWHATEVER', /unknown error EWHATEVER/],
  ])('refuses %s', (plan, message) => {
    expect(() => addon.faultsSet(plan)).toThrow(message);
    expect(addon.faultsState().active).toBe(false);
  });

  it('refuses a bad VMMD_FAULTS at start: the daemon does not run untested', async () => {
    await expect(TestDaemon.start([], 'host', { VMMD_FAULTS: 'dup:zero:EMFILE' })).rejects.toThrow(/VMMD_FAULTS/);
  });
});
