/** SEQPACKET sockets and SCM_RIGHTS through the addon, in one process. */
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { addon } from '../../native';
import { SeqpacketConnection, SeqpacketListener, SeqpacketMessage, MAX_MESSAGE_BYTES, MAX_MESSAGES_PER_READ } from '../../native/seqpacket';

let dir: string;
let listener: SeqpacketListener;
let server: SeqpacketConnection;
let client: SeqpacketConnection;

function nextMessage(connection: SeqpacketConnection): Promise<SeqpacketMessage> {
  return new Promise((resolve) => connection.once('message', resolve));
}

beforeEach(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-fd-'));
  listener = new SeqpacketListener(path.join(dir, 's.sock'));
  const accepted = new Promise<SeqpacketConnection>((resolve) => listener.once('connection', resolve));
  client = SeqpacketConnection.connect(path.join(dir, 's.sock'));
  server = await accepted;
});

afterEach(() => {
  client.close();
  server.close();
  listener.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

describe('SEQPACKET with descriptors', () => {
  it('reads the peer credentials at accept', () => {
    expect(server.peer).toEqual({ pid: process.pid, uid: process.getuid!(), gid: process.getgid!() });
  });

  it('keeps message boundaries and passes a descriptor to the same file', async () => {
    const fd = addon.hostMemfdCreate('passed', 2n << 20n);
    const first = nextMessage(server);
    client.send(Buffer.from('one'), fd);
    const message = await first;
    expect(message.data.toString()).toBe('one');
    expect(message.fd).toBeGreaterThanOrEqual(0);
    expect(message.fd).not.toBe(fd);
    expect(addon.hostFdInfo(message.fd).inode).toBe(addon.hostFdInfo(fd).inode);
    const second = nextMessage(server);
    client.send(Buffer.from('two'));
    expect(await second).toMatchObject({ fd: -1, truncated: false });
    addon.close(message.fd);
    addon.close(fd);
  });

  it.each([
    [3, 2, false],
    // Past the room for 16 descriptors: the kernel closes the rest and says so.
    [20, 15, true],
  ])('keeps the first of %i descriptors on one message and closes the others (%i counted), leaking none', async (count, extra, dropped) => {
    const openFds = () => fs.readdirSync('/proc/self/fd').length;
    const files = Array.from({ length: count }, () => fs.openSync(__filename, 'r'));
    const before = openFds();
    const received = nextMessage(server);
    // The daemon's own send carries one descriptor at most; a hostile peer's carries many.
    addon.unixDgramSendFds((client as unknown as { fd: number }).fd, Buffer.from('many'), files);
    const message = await received;
    expect(message).toMatchObject({ extraFds: extra, descriptorsDropped: dropped, truncated: false });
    expect(message.data.toString()).toBe('many');
    expect(fs.fstatSync(message.fd).ino).toBe(fs.statSync(__filename).ino);
    expect(openFds()).toBe(before + 1);
    addon.close(message.fd);
    files.forEach((fd) => fs.closeSync(fd));
  });

  it('cuts an oversized message and says so', async () => {
    const received = nextMessage(server);
    client.send(Buffer.alloc(MAX_MESSAGE_BYTES + 100, 1));
    const message = await received;
    expect(message.truncated).toBe(true);
    expect(message.data.length).toBe(MAX_MESSAGE_BYTES);
  });

  it('takes an empty record for an empty message, not for the peer hanging up (found by the hostile-input suite)', async () => {
    const received = nextMessage(server);
    client.send(Buffer.alloc(0));
    const message = await received;
    expect(message.data.length).toBe(0);
    expect(server.isClosed).toBe(false);
    const next = nextMessage(server);
    client.send(Buffer.from('still here'));
    expect((await next).data.toString()).toBe('still here');
  });

  it('reads at most MAX_MESSAGES_PER_READ messages a turn: a peer with many queued cannot hold the event loop, and every one arrives, in order', async () => {
    const count = 3 * MAX_MESSAGES_PER_READ + 5;
    const seen: string[] = [];
    let atFirstTurnEnd = -1;
    const all = new Promise<void>((resolve) => {
      const onMessage = (message: SeqpacketMessage) => {
        // The check phase right after the poll callback that read the first message: how many that callback read.
        if (seen.length === 0) setImmediate(() => (atFirstTurnEnd = seen.length));
        seen.push(message.data.toString());
        if (seen.length === count) {
          server.off('message', onMessage);
          resolve();
        }
      };
      server.on('message', onMessage);
    });
    for (let i = 0; i < count; i++) client.send(Buffer.from(`m${i}`));
    await all;
    expect(atFirstTurnEnd).toBe(MAX_MESSAGES_PER_READ);
    expect(seen).toEqual(Array.from({ length: count }, (_, i) => `m${i}`));
  });

  it('delivers every queued message before the close when the peer sends many and goes away', async () => {
    const count = 2 * MAX_MESSAGES_PER_READ + 3;
    const seen: string[] = [];
    server.on('message', (message: SeqpacketMessage) => seen.push(message.data.toString()));
    const closed = new Promise((resolve) => server.once('close', resolve));
    for (let i = 0; i < count; i++) client.send(Buffer.from(`m${i}`));
    client.close();
    await closed;
    expect(seen).toHaveLength(count);
  });

  it('delivers what a peer sent before it closed with a message of ours unread (the read meets a reset first), then the close', async () => {
    const rawPath = path.join(dir, 'raw.sock');
    const listening = addon.seqpacketListen(rawPath, 4);
    try {
      const peer = SeqpacketConnection.connect(rawPath);
      const accepted = addon.seqpacketAccept(listening)!;
      peer.send(Buffer.from('hello'));
      const seen: string[] = [];
      peer.on('message', (message: SeqpacketMessage) => seen.push(message.data.toString()));
      const closed = new Promise((resolve) => peer.once('close', resolve));
      // The other end answers and closes without reading: the kernel resets this side, ahead of the answer still queued.
      addon.seqpacketSend(accepted.fd, Buffer.from('refused'), -1);
      addon.close(accepted.fd);
      await closed;
      expect(seen).toEqual(['refused']);
    } finally {
      addon.close(listening);
    }
  });

  it('a listener out of descriptors reads what the connection it turns away sent before it refuses and closes: the refusal reaches the client', async () => {
    const refusing = new SeqpacketListener(path.join(dir, 'refusing.sock'), 16, Buffer.from('out of descriptors'));
    try {
      const peer = SeqpacketConnection.connect(path.join(dir, 'refusing.sock'));
      peer.send(Buffer.from('hello'));
      const seen: string[] = [];
      peer.on('message', (message: SeqpacketMessage) => seen.push(message.data.toString()));
      const closed = new Promise((resolve) => peer.once('close', resolve));
      // Turned away as when accept finds no descriptor: the spare is given up for this one connection.
      (refusing as unknown as { turnAway(): string }).turnAway();
      await closed;
      expect(seen).toEqual(['out of descriptors']);
    } finally {
      refusing.close();
    }
  });

  it('emits close when the peer goes away', async () => {
    const closed = new Promise((resolve) => server.once('close', resolve));
    client.close();
    await closed;
    expect(server.isClosed).toBe(true);
  });
});

describe('datagram sockets with descriptors (the fd store)', () => {
  test('a socket bound to a path receives what a connected one sends, data and descriptors, and one sent to the path alike', () => {
    const at = path.join(dir, 'd.sock');
    const bound = addon.unixDgramBind(at);
    const connected = addon.unixDgramConnect(at);
    const fds = [fs.openSync(__filename, 'r'), fs.openSync(__filename, 'r')];
    try {
      addon.unixDgramSendFds(connected, Buffer.from('FDSTORE=1'), fds);
      const first = addon.unixDgramRecvFds(bound, 64)!;
      expect(first.data.toString()).toBe('FDSTORE=1');
      expect(first.fds).toHaveLength(2);
      for (const fd of first.fds) expect(fs.fstatSync(fd).ino).toBe(fs.statSync(__filename).ino);
      first.fds.forEach((fd) => fs.closeSync(fd));
      addon.unixDgramSendFds(at, Buffer.from('READY=1'), []);
      const second = addon.unixDgramRecvFds(bound, 64)!;
      expect([second.data.toString(), second.fds]).toEqual(['READY=1', []]);
      expect(addon.unixDgramRecvFds(bound, 64)).toBeNull();
    } finally {
      fds.forEach((fd) => fs.closeSync(fd));
      addon.close(connected);
      addon.close(bound);
    }
  });

  test('binding a path in use and connecting to a path without a socket fail naming the call and the path', () => {
    const at = path.join(dir, 'd.sock');
    const bound = addon.unixDgramBind(at);
    try {
      expect(() => addon.unixDgramBind(at)).toThrow(expect.objectContaining({ code: 'EADDRINUSE', message: expect.stringContaining(`bind(${at})`) }));
      const missing = path.join(dir, 'none.sock');
      expect(() => addon.unixDgramConnect(missing)).toThrow(
        expect.objectContaining({ code: 'ENOENT', message: expect.stringContaining(`connect(${missing})`) }),
      );
    } finally {
      addon.close(bound);
    }
  });
});
