/**
 * A hostile session against the staging buffers: OpenStaging calls sent at
 * once on one session each bring a memfd the daemon maps; one buffer per
 * session is the rule, so every buffer but the last must be unmapped and its
 * descriptor closed, and the session's close must take the last. Whatever a
 * session does, the daemon must hold none of its staging memfds once it is
 * gone: a leak here is a daemon mapping and descriptor per call, outside
 * every budget.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { call, eventually, MiB, stopWhenClean, TestDaemon } from './harness';

const NAME = 'attack-staging';
const CALLS = 16;

let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];

afterEach(async () => {
  await stopWhenClean(daemon, clients);
  daemon = undefined;
});

/** The daemon's descriptors and mappings of memfds named NAME. */
function stagingHeld(pid: number): { descriptors: number; mappings: number } {
  let descriptors = 0;
  for (const entry of fs.readdirSync(`/proc/${pid}/fd`)) {
    try {
      if (fs.readlinkSync(`/proc/${pid}/fd/${entry}`).includes(`memfd:${NAME}`)) descriptors++;
    } catch {
      // Closed while listed.
    }
  }
  const mappings = fs
    .readFileSync(`/proc/${pid}/maps`, 'utf8')
    .split('\n')
    .filter((line) => line.includes(`memfd:${NAME}`)).length;
  return { descriptors, mappings };
}

describe('staging buffers against a hostile session', () => {
  it('OpenStaging calls sent at once leave one buffer, and none once the session is gone', async () => {
    daemon = await TestDaemon.start();
    const attacker = await connect({ socketDir: daemon.dir, stagingBytes: 0 } as never);
    clients.push(attacker);
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, attacker.session.token);
    const calls = [];
    for (let i = 0; i < CALLS; i++) {
      const fd = addon._memfdCreate(NAME, 1n * MiB, true);
      calls.push(call(daemon.raw.vmm, 'OpenStaging', { transferId: attacker.session.sendDescriptor(fd) }, metadata).finally(() => addon.close(fd)));
    }
    await Promise.allSettled(calls);
    // One buffer per session: at most one of them is still the daemon's.
    const during = stagingHeld(daemon.pid);
    expect(during.descriptors).toBeLessThanOrEqual(1);
    attacker.close();
    clients.splice(0);
    await eventually(async () => ((await daemon!.stats()).sessions === 0 ? true : undefined), 10_000, 'the session to close');
    await eventually(
      () => {
        const held = stagingHeld(daemon!.pid);
        return held.descriptors === 0 && held.mappings === 0 ? true : undefined;
      },
      20_000,
      'the daemon to let go of every staging buffer',
    ).catch(() => undefined);
    expect(stagingHeld(daemon.pid)).toEqual({ descriptors: 0, mappings: 0 });
  });
});
