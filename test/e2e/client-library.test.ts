/**
 * The client library as issue 17 (item 7) found it: memory opened from
 * another process's IPC handle is read and written through the manager that
 * opened it, like its own (no reaching into `pointer.owner`); once freed, the
 * manager says so; and client.backend is the type the manager takes.
 */
import { connect, VmmdClient, VmmdMemoryManager } from '../../client';
import { TestDaemon } from './harness';

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
});
