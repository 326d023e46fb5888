/**
 * Sessions across a restart of the daemon, under vmmd's keeper: the hello's
 * resume token, the TypeScript client resuming by itself after a SIGKILL of
 * the serving daemon (same session, same objects, memory mapped throughout),
 * calls made meanwhile waiting for it, and the refusals a resume can meet.
 */
import * as fs from 'node:fs';
import { createHash } from 'node:crypto';
import { connect, VmmdClient, VmmdError } from '../../client';
import { PROTOCOL_VERSION } from '../../common/protocol';
import { call, eventually, MiB, RawSession, TestDaemon } from './harness';

/** The serving daemon under a keeper: the keeper's only child. */
function servingPid(keeper: number): number | undefined {
  const children = fs.readFileSync(`/proc/${keeper}/task/${keeper}/children`, 'utf8').trim();
  return children === '' ? undefined : Number(children.split(' ')[0]);
}

/** SIGKILLs the serving daemon; resolves once the keeper started the next one (not yet serving, perhaps). */
async function killServing(daemon: TestDaemon): Promise<void> {
  const before = servingPid(daemon.pid)!;
  process.kill(before, 'SIGKILL');
  await eventually(
    () => {
      const pid = servingPid(daemon.pid);
      return pid !== undefined && pid !== before ? pid : undefined;
    },
    30_000,
    'the keeper to start the daemon again',
  );
}

const allocationsOf = async (daemon: TestDaemon) =>
  (await call(daemon.raw.admin, 'ListObjects', {})).objects
    .filter((o: any) => o.kind === 'allocation')
    .map((o: any) => ({ id: o.id, owner: o.ownerSession, size: o.size }))
    .sort((a: any, b: any) => Number(a.id) - Number(b.id));

describe('session resume', () => {
  let daemon: TestDaemon | undefined;
  const clients: VmmdClient[] = [];
  afterEach(async () => {
    for (const client of clients.splice(0)) client.close();
    await daemon?.stop();
    daemon = undefined;
  });

  it('gives no resume token where the daemon parks nothing', async () => {
    daemon = await TestDaemon.start();
    const raw = new RawSession(daemon.dir);
    const hello = await raw.next();
    expect(hello.type).toBe('hello');
    expect(hello.resumeToken).toBe('');
    expect(hello.resumed).toBe(false);
    raw.close();
  }, 60_000);

  it('an allocate sent again (after a restart cut off its answer) is answered by the allocation it made, not a second one', async () => {
    daemon = await TestDaemon.start();
    const raw = new RawSession(daemon.dir);
    await raw.next();
    const allocate = (again?: boolean) => raw.send({ request: '5', allocate: { size: String(2n * MiB) }, again });
    allocate();
    const first = await raw.next();
    expect(first).toMatchObject({ type: 'allocated', request: '5' });
    allocate(true);
    expect(await raw.next()).toMatchObject({ type: 'allocated', request: '5', allocationId: first.allocationId });
    expect((await daemon.stats()).allocations).toBe('1');
    // An id the daemon made nothing for is a new allocation.
    raw.send({ request: '6', allocate: { size: String(2n * MiB) }, again: true });
    expect(await raw.next()).toMatchObject({ type: 'allocated', request: '6' });
    expect((await daemon.stats()).allocations).toBe('2');
    raw.close();
  }, 60_000);

  it('a SIGKILLed daemon: the client resumes its session by itself, owning what it owned; memory mapped stays valid; calls made meanwhile wait', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--quota-per-uid', '64MiB', '--parked-grace-ms', '60000']);
    const client = await connect({ socketDir: daemon.dir });
    clients.push(client);
    expect(client.session.resumeToken).toMatch(/^[0-9a-f]{64}$/);
    const events: string[] = [];
    for (const event of ['resuming', 'resumed', 'session-lost']) client.on(event, () => events.push(event));
    const memory = await client.vmm.allocate({ size: 4n * MiB });
    const bytes = Buffer.alloc(Number(memory.size));
    for (let i = 0; i < bytes.length; i += 4096) bytes[i] = (i >> 12) & 0xff;
    await memory.write(0, bytes);
    const sum = createHash('sha256')
      .update(await memory.read(0, memory.size))
      .digest('hex');
    const { shareKey } = await client.vmm.share({ allocationId: memory.allocationId });
    const before = await allocationsOf(daemon);
    const quotaBefore = JSON.parse((await call(daemon.raw.admin, 'GetReport', {})).json).quotas;

    await killServing(daemon);
    await eventually(() => (events.includes('resuming') ? true : undefined), 10_000, 'the client to notice');
    // Made while the session is away: they wait for it, then go.
    const during = Promise.all([
      client.vmm.allocate({ size: 2n * MiB }),
      client.devices.getGranularity(),
      client.vmm.share({ allocationId: memory.allocationId }),
    ]);
    // The memory mapped here is untouched by the daemon's death.
    expect(
      createHash('sha256')
        .update(await memory.read(0, memory.size))
        .digest('hex'),
    ).toBe(sum);
    const [second, granularity, shared] = await during;
    expect(events).toEqual(['resuming', 'resumed']);
    expect(client.lost).toBe(false);
    expect(granularity.minimum).toBeDefined();
    expect(shared.shareKey).toBe(shareKey);
    // Same session, same objects: the allocation is still this session's, its bytes as they were.
    const after = await allocationsOf(daemon);
    expect(after.filter((a: any) => a.id !== String(second.allocationId))).toEqual(before);
    expect(after.find((a: any) => a.id === String(second.allocationId)).owner).toBe(client.session.id);
    expect(
      createHash('sha256')
        .update(await memory.read(0, memory.size))
        .digest('hex'),
    ).toBe(sum);
    await second.close();
    await client.vmm.release({ allocationId: second.allocationId });
    // Its charges as before, the new allocation released.
    const quotas = async () => JSON.parse((await call(daemon!.raw.admin, 'GetReport', {})).json).quotas;
    await eventually(async () => (JSON.stringify(await quotas()) === JSON.stringify(quotaBefore) ? true : undefined), 10_000, 'the quotas as before');
    // The session's own allocation is released as before: the client owns it.
    await memory.close();
    await client.vmm.release({ allocationId: memory.allocationId });
    expect(await allocationsOf(daemon)).toEqual([]);
  }, 120_000);

  it('a session not resumed within the grace is reclaimed; its client hears SESSION_LOST naming SESSION_RECLAIMED, not a hang', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '0']);
    const client = await connect({ socketDir: daemon.dir });
    clients.push(client);
    const lost: VmmdError[] = [];
    client.on('session-lost', (error: VmmdError) => lost.push(error));
    const memory = await client.vmm.allocate({ size: 2n * MiB });
    await killServing(daemon);
    await eventually(() => (lost.length > 0 ? true : undefined), 30_000, 'the client to hear');
    expect(lost[0]).toMatchObject({ code: 'SESSION_LOST' });
    expect(lost[0].message).toMatch(/could not be resumed.*SESSION_RECLAIMED.*memory mapped in this process stays valid/);
    await expect(client.vmm.allocate({ size: 2n * MiB })).rejects.toMatchObject({ code: 'SESSION_LOST' });
    await eventually(async () => ((await allocationsOf(daemon!)).length === 0 ? true : undefined), 10_000, 'the reclaim');
    // The memory mapped here stays valid.
    await memory.write(0, Buffer.from('still mapped'));
    expect((await memory.read(0, 12)).toString()).toBe('still mapped');
    await memory.close().catch(() => undefined);
  }, 120_000);

  it('a resume with an unknown or malformed token is refused with a clear code, and the connection serves a fresh session', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on']);
    const first = new RawSession(daemon.dir);
    const hello = await first.next();
    expect(hello.resumeToken).toMatch(/^[0-9a-f]{64}$/);
    const resuming = (resumeToken: string) => {
      const raw = new RawSession(daemon!.dir, false);
      raw.send({ hello: { protocol: PROTOCOL_VERSION, resumeToken } });
      return raw;
    };
    const unknown = resuming('f'.repeat(64));
    expect(await unknown.next()).toMatchObject({ type: 'error', request: '0', code: 'RESUME_UNKNOWN', status: 5 });
    expect(await unknown.next()).toMatchObject({ type: 'hello', resumed: false, resumeToken: expect.stringMatching(/^[0-9a-f]{64}$/) });
    unknown.send({ request: '1', ping: { nonce: '1' } });
    expect(await unknown.next()).toMatchObject({ type: 'pong', request: '1', nonce: '1' });
    const malformed = resuming('xyz');
    expect(await malformed.next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', message: 'hello: resumeToken "xyz" is not 64 lowercase hex digits' });
    expect(await malformed.next()).toMatchObject({ type: 'hello', resumed: false });
    // The hello comes once, first: a later one resumes nothing.
    first.send({ hello: { protocol: PROTOCOL_VERSION, resumeToken: hello.resumeToken } });
    expect(await first.next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE' });
    // An open session is not waiting to be resumed: its token names nothing to take over.
    const open = resuming(hello.resumeToken);
    expect(await open.next()).toMatchObject({ type: 'error', code: 'RESUME_UNKNOWN' });
    expect(await open.next()).toMatchObject({ type: 'hello', resumed: false });
    expect((await daemon.stats()).sessions).toBe(4);
    for (const raw of [first, unknown, malformed, open]) raw.close();
  }, 60_000);
});
