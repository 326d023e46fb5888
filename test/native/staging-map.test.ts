/**
 * A staging buffer the daemon cannot map for a reason of its own (out of
 * address space or of mappings: mmap ENOMEM) is refused with a daemon-side
 * code, not BAD_DESCRIPTOR, which would tell the client its descriptor is at
 * fault; one whose mapping the client's seals forbid still is BAD_DESCRIPTOR.
 */
import { status as Status } from '@grpc/grpc-js';
import { addon } from '../../native';
import { StagingBuffers } from '../../server/stores/staging';

const SESSION = 9n;

describe('a staging buffer the daemon cannot map', () => {
  afterEach(() => addon.faultsSet(''));

  it.each(['mmap:reserve', 'mmap:map'])('is RESOURCE_EXHAUSTED DAEMON_MAP_FAILED when %s fails ENOMEM, and the descriptor is closed', async (call) => {
    const staging = new StagingBuffers();
    const fd = addon.hostMemfdCreate('staging', 1n << 20n);
    const copy = addon.dup(fd);
    addon.faultsSet(`${call}:1:ENOMEM`);
    await expect(staging.open(SESSION, fd)).rejects.toMatchObject({
      status: Status.RESOURCE_EXHAUSTED,
      code: 'DAEMON_MAP_FAILED',
      message: expect.stringMatching(/ENOMEM/),
    });
    addon.faultsSet('');
    // Taken over and closed: its number may be reused, but it no longer names the staging memfd.
    expect(() => addon.hostFdInfo(fd)).toThrow();
    // Nothing stays: the session has no buffer, and a later open works.
    await staging.open(SESSION, copy);
    await staging.close(SESSION);
  });
});
