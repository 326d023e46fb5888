/**
 * The client library's handling of other processes' memory: memory opened from
 * another process's IPC handle is read and written through the manager that
 * opened it, like its own (no reaching into `pointer.owner`); once freed, the
 * manager says so; and client.backend is the type the manager takes. A cold
 * free returns before the daemon answers its release: flush()
 * waits for the release, and a refused release is a warning, not a free that
 * fails.
 */
import { status as Status } from '@grpc/grpc-js';
import { connect, VmmdClient, VmmdError, VmmdMemoryManager } from '../../client';
import { MiB, TestDaemon } from './harness';

describe('VmmdMemoryManager and openIpcHandle', () => {
  let daemon: TestDaemon;
  const clients: VmmdClient[] = [];

  beforeAll(async () => {
    daemon = await TestDaemon.start();
  });

  afterAll(async () => {
    for (const client of clients) client.close();
    expect(await daemon.stop()).toBe(0);
  });

  async function manager(): Promise<VmmdMemoryManager> {
    const client = await connect({ socketDir: daemon.dir });
    clients.push(client);
    // client.backend is 'host' | 'cuda': this type-checks as written in the issue.
    const made = new VmmdMemoryManager({ client, device: 0, backend: client.backend });
    await made.initialize();
    return made;
  }

  test('read and write an opened handle through the manager; NOT_MANAGED once freed', async () => {
    const owner = await manager();
    const other = await manager();
    const pointer = await owner.memalloc(4096);
    await owner.write(pointer.pointer, Buffer.from('written by the owner'));
    const opened = await other.openIpcHandle(await owner.getIpcHandle(pointer));
    expect((await other.read(opened.pointer, 20)).toString()).toBe('written by the owner');
    await other.write(opened.pointer + 8n, Buffer.from('OTHER'));
    expect((await owner.read(pointer.pointer, 20)).toString()).toBe('written OTHERe owner');
    // An address inside the opened range, not only its start.
    expect((await other.read(opened.pointer + 8n, 5)).toString()).toBe('OTHER');
    await opened.free();
    await expect(other.read(opened.pointer, 1)).rejects.toMatchObject({ code: 'NOT_MANAGED' });
    await expect(other.write(opened.pointer, Buffer.from('x'))).rejects.toMatchObject({ code: 'NOT_MANAGED' });
    await pointer.free();
  });

  /** A manager whose every memalloc is a new allocation and whose frees run at once (the cold path), and its client. */
  async function coldManager(): Promise<{ client: VmmdClient; mm: VmmdMemoryManager }> {
    const client = await connect({ socketDir: daemon.dir });
    clients.push(client);
    const mm = new VmmdMemoryManager({
      client,
      device: 0,
      backend: client.backend,
      pool: { chunkSize: 2n * MiB, largeThreshold: 0n },
      deferred: { count: 0, ratio: 1 },
    });
    await mm.initialize();
    return { client, mm };
  }

  test('a cold free returns before the daemon answers its release; flush() waits for the release', async () => {
    const { client, mm } = await coldManager();
    // The release is held back until the test lets it go.
    const release = client.vmm.release.bind(client.vmm);
    let letGo!: () => void;
    const gate = new Promise<void>((resolve) => (letGo = resolve));
    client.vmm.release = (request) => gate.then(() => release(request));
    const before = (await daemon.stats()).allocations;
    const pointer = await mm.memalloc(2n * MiB);
    await pointer.free();
    // Freed here; the daemon has not been asked yet.
    expect((await daemon.stats()).allocations).toBe(String(Number(before) + 1));
    let flushed = false;
    const flushing = mm.flush().then(() => (flushed = true));
    await new Promise((resolve) => setTimeout(resolve, 20));
    expect(flushed).toBe(false);
    letGo();
    await flushing;
    expect((await daemon.stats()).allocations).toBe(before);
    await mm.reset();
  });

  test('a release the daemon refuses after a free is a warning, not a failed free', async () => {
    const { client, mm } = await coldManager();
    const release = client.vmm.release.bind(client.vmm);
    client.vmm.release = () => Promise.reject(new VmmdError('NOT_OWNER', Status.PERMISSION_DENIED, 'refused for the test'));
    const warned = jest.spyOn(process, 'emitWarning').mockImplementation(() => undefined);
    try {
      const pointer = await mm.memalloc(2n * MiB);
      await expect(pointer.free()).resolves.toBeUndefined();
      await mm.flush();
      expect(warned.mock.calls.map(([message]) => String(message))).toContainEqual(
        expect.stringMatching(/releasing allocation \d+ failed: refused for the test/),
      );
    } finally {
      warned.mockRestore();
      client.vmm.release = release;
      await mm.reset();
    }
  });
});
