/**
 * A session whose socket closes while its allocate is in flight (the memory
 * being made off the event loop, as cuMemCreate is on a driver thread): the
 * real transport (server/transport/session/sessions.ts) over the real dispatcher, registry,
 * quotas and host backend. The reclaim waits for the create, then frees what
 * it made: no memory, no descriptor and no quota charge is left.
 */
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { status as Status } from '@grpc/grpc-js';
import { ClientSession } from '../../client/session';
import { HostBackend } from '../../server/backends/host';
import { Quotas } from '../../server/registry/quotas';
import { Registry } from '../../server/registry';
import { socketDispatcher } from '../unit/socket-dispatcher';
import { SessionManager } from '../../server/transport/session/sessions';
import { RecordingBackend } from '../contracts/recording-backend';

const MiB = 1n << 20n;

async function until(condition: () => boolean): Promise<void> {
  for (let waited = 0; !condition() && waited < 10_000; waited++) await new Promise((resolve) => setTimeout(resolve, 1));
  expect(condition()).toBe(true);
}

/** This process's descriptors of the host backend's memfds (the memory's and those exported for answers). */
const memfdDescriptors = () =>
  fs.readdirSync('/proc/self/fd').filter((fd) => {
    try {
      return fs.readlinkSync(`/proc/self/fd/${fd}`).startsWith('/memfd:vmmd:');
    } catch {
      return false; // closed meanwhile (the directory's own descriptor)
    }
  }).length;

it('frees what a session was allocating when its socket closed mid-create, refusing its token meanwhile: nothing leaks', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-create-in-flight-'));
  const backend = new RecordingBackend(new HostBackend({ capacity: 64n * MiB, granularity: 2n * MiB }));
  const sessions = new SessionManager(pino({ level: 'silent' }));
  const quotas = new Quotas({ perUid: 0n, perSession: 6n * MiB }, (session) => sessions.uidOf(session));
  const registry = new Registry(backend, (upstream) => quotas.around(upstream, (handle, device) => backend.memoryIdentity(handle, device)));
  sessions.listen(path.join(dir, 'session.sock'), socketDispatcher(registry));
  try {
    // Counted from what the jest worker holds already: an earlier test file in this worker may keep a memfd of its own.
    const held = memfdDescriptors();
    const client = await ClientSession.open(path.join(dir, 'session.sock'), 5_000);
    let open!: () => void;
    backend.createGate = new Promise<void>((resolve) => (open = resolve));
    // Four asked, three within the quota: the fourth is refused at once, before any memory is made.
    let answered = 0;
    const answers = Array.from({ length: 4 }, () =>
      client.allocate(2n * MiB).then(
        () => 'allocated',
        (error: { code: string }) => (answered++, error.code),
      ),
    );
    await until(() => backend.liveHandles === 3 && answered === 1);
    expect(memfdDescriptors()).toBe(held + 3);
    expect(quotas.used().bySession).toEqual({ [client.id]: String(6n * MiB) });

    client.close();
    await until(() => sessions.list()[0]?.closing === true);
    // The reclaim waits for the calls in flight: the session, its charge and the memory are all still there.
    await new Promise((resolve) => setTimeout(resolve, 20));
    expect(sessions.count).toBe(1);
    expect(registry.stats().allocations).toBe(0);
    // A call presenting the closing session's token is refused as unauthenticated, with a code saying it is closing.
    expect(() => sessions.authenticate(client.token)).toThrow(expect.objectContaining({ status: Status.UNAUTHENTICATED, code: 'SESSION_CLOSING' }));

    open();
    await until(() => sessions.count === 0);
    expect(() => sessions.authenticate(client.token)).toThrow(expect.objectContaining({ status: Status.UNAUTHENTICATED, code: 'UNKNOWN_SESSION' }));
    expect((await Promise.all(answers)).sort()).toEqual(['QUOTA_EXCEEDED', 'SESSION_LOST', 'SESSION_LOST', 'SESSION_LOST']);
    expect(registry.snapshot()).toEqual({ reservations: [], allocations: [] });
    expect(registry.stats()).toMatchObject({ allocations: 0, allocatedBytes: 0n });
    expect(backend.liveHandles).toBe(0);
    expect(backend.calls.filter((call) => call === 'release')).toHaveLength(3);
    expect(quotas.used()).toEqual({ byUid: {}, bySession: {} });
    // Each memfd, and each descriptor exported for an answer that could not be sent, was closed.
    expect(memfdDescriptors()).toBe(held);
  } finally {
    await sessions.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
