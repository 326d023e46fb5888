/**
 * The daemon against a stand-in of systemd's file-descriptor store, written
 * here from systemd's protocol and not from vmmd's keeper: a datagram
 * NOTIFY_SOCKET that keeps what comes with FDSTORE=1 under its FDNAME, drops
 * a name on FDSTOREREMOVE=1, and starts the daemon again with the
 * descriptors from fd 3 on, LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID.
 */
import { ChildProcess, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { addon } from '../../native';
import { call, eventually, MiB, packageRoot, Peer, rawClients, RawClients } from '../e2e/harness';

class ServiceManagerStandIn {
  readonly dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-fdstore-'));
  readonly socketPath = path.join(this.dir, 'notify');
  private readonly socket = addon.unixDgramBind(this.socketPath);
  readonly held: Array<{ name: string; fd: number }> = [];
  readonly messages: string[] = [];
  daemon?: ChildProcess;
  raw?: RawClients;
  // Read as they come, as systemd's event loop does: a queue left full would block the daemon's next send.
  private readonly reader = setInterval(() => this.drain(), 2);

  /** Reads every waiting notification, as systemd's manager_dispatch_notify_fd does. */
  drain(): void {
    for (let message = addon.unixDgramRecvFds(this.socket, 4096); message !== null; message = addon.unixDgramRecvFds(this.socket, 4096)) {
      const text = message.data.toString();
      this.messages.push(text);
      const fields = new Map(text.split('\n').map((line) => [line.slice(0, line.indexOf('=')), line.slice(line.indexOf('=') + 1)]));
      if (fields.get('FDSTORE') === '1') {
        for (const fd of message.fds) this.held.push({ name: fields.get('FDNAME') ?? 'stored', fd });
        continue;
      }
      for (const fd of message.fds) addon.close(fd);
      if (fields.get('FDSTOREREMOVE') === '1') {
        for (let index = this.held.length - 1; index >= 0; index--) {
          if (this.held[index].name !== fields.get('FDNAME')) continue;
          addon.close(this.held[index].fd);
          this.held.splice(index, 1);
        }
      }
    }
  }

  names(): string[] {
    this.drain();
    return this.held.map((entry) => entry.name);
  }

  async start(): Promise<void> {
    this.drain();
    const env: NodeJS.ProcessEnv = { ...process.env, NOTIFY_SOCKET: this.socketPath };
    if (this.held.length > 0) {
      env.LISTEN_FDS = String(this.held.length);
      env.LISTEN_FDNAMES = this.held.map((entry) => entry.name).join(':');
    }
    const daemon = path.join(packageRoot(), 'bin', 'vmmd.js');
    this.daemon = spawn(
      '/bin/sh',
      [
        '-c',
        'LISTEN_PID=$$ exec "$0" "$@"',
        process.execPath,
        daemon,
        '--backend',
        'host',
        '--socket-dir',
        this.dir,
        '--host-capacity',
        '256MiB',
        '--log-level',
        'warn',
        '--parked-grace-ms',
        '600000',
      ],
      {
        env,
        stdio: ['ignore', 'inherit', 'inherit', ...this.held.map((entry) => entry.fd)],
      },
    );
    this.raw = rawClients(this.dir);
    await eventually(
      () =>
        call(this.raw!.devices, 'ListDevices', {}).then(
          () => true,
          () => undefined,
        ),
      60_000,
      'the daemon to serve',
    );
  }

  async kill(signal: NodeJS.Signals = 'SIGKILL'): Promise<void> {
    this.raw?.close();
    const exited = new Promise((resolve) => this.daemon!.once('exit', resolve));
    this.daemon!.kill(signal);
    await exited;
  }

  async close(): Promise<void> {
    if (this.daemon !== undefined && this.daemon.exitCode === null && this.daemon.signalCode === null) await this.kill('SIGTERM');
    clearInterval(this.reader);
    this.drain();
    for (const entry of this.held.splice(0)) addon.close(entry.fd);
    addon.close(this.socket);
    fs.rmSync(this.dir, { recursive: true, force: true });
  }
}

describe("systemd's file-descriptor store (a stand-in of the protocol)", () => {
  let manager: ServiceManagerStandIn | undefined;
  const peers: Peer[] = [];
  afterEach(async () => {
    for (const peer of peers.splice(0)) await peer.kill();
    await manager?.close();
    manager = undefined;
  });

  it('parks each allocation and the journal, drops what is freed, and restores the rest after SIGKILL', async () => {
    manager = new ServiceManagerStandIn();
    await manager.start();
    // A journal is parked at once.
    expect(manager.names().filter((name) => /^j\d+$/.test(name))).toHaveLength(1);
    const peer = await Peer.start(manager.dir);
    peers.push(peer);
    const kept = await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    const store = await peer.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: kept.id, name: 'parked', handOver: true } });
    await peer.do({ op: 'storeWrite', id: store.id, text: 'parked bytes' });
    const freed = await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    const memory = () => manager!.names().filter((name) => !/^j\d+$/.test(name));
    expect(memory()).toHaveLength(2);
    await peer.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: freed.id } });
    // FDSTOREREMOVE: the freed allocation's descriptor leaves the store.
    await eventually(() => (memory().length === 1 ? true : undefined), 10_000, 'the freed descriptor to leave the store');

    await manager.kill();
    await peer.kill();
    peers.splice(0);
    await manager.start();
    const stores = (await call(manager.raw!.stores, 'List', {})).stores;
    expect(stores.map((s: any) => [s.name, s.allocationId])).toEqual([['parked', kept.id]]);
    const reader = await Peer.start(manager.dir);
    peers.push(reader);
    const opened = await reader.do({ op: 'storeOpen', name: 'parked' });
    const expected = Buffer.alloc(Number(2n * MiB));
    expected.write('parked bytes');
    expect((await reader.do({ op: 'storeChecksum', handle: opened.handle })).sha256).toBe(createHash('sha256').update(expected).digest('hex'));
    const objects = (await call(manager.raw!.admin, 'ListObjects', {})).objects.filter((o: any) => o.kind === 'allocation').map((o: any) => o.id);
    expect(objects).toEqual([kept.id]);
  }, 120_000);

  it('leaves everything parked through a clean stop (SIGTERM), as systemctl restart stops and starts the daemon', async () => {
    manager = new ServiceManagerStandIn();
    await manager.start();
    const peer = await Peer.start(manager.dir);
    peers.push(peer);
    const allocation = await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await peer.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: allocation.id, name: 'restarted', handOver: true } });
    const own = await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await manager.kill('SIGTERM');
    await peer.kill();
    peers.splice(0);
    await manager.start();
    expect((await call(manager.raw!.stores, 'List', {})).stores.map((s: any) => s.name)).toEqual(['restarted']);
    const objects = (await call(manager.raw!.admin, 'ListObjects', {})).objects.filter((o: any) => o.kind === 'allocation').map((o: any) => o.id);
    expect(objects.sort()).toEqual([allocation.id, own.id].sort());
  }, 120_000);

  it('compacts a journal grown long into a new one, parked before the old one goes, and restores from it', async () => {
    manager = new ServiceManagerStandIn();
    await manager.start();
    const peer = await Peer.start(manager.dir);
    peers.push(peer);
    const kept = await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    // Churn: 2,400 allocations made and released (120 at a time: the host capacity), two lines each, past the journal's slack of 4,096 lines.
    const size = String(2n * MiB);
    for (let round = 0; round < 20; round++) {
      expect((await peer.do({ op: 'many', api: 'vmm', method: 'create', args: Array.from({ length: 120 }, () => ({ size })), parallel: 8 })).done).toBe(120);
      const ids = (await call(manager.raw!.admin, 'ListObjects', {})).objects
        .filter((o: any) => o.kind === 'allocation' && o.id !== kept.id)
        .map((o: any) => ({ allocationId: o.id }));
      expect((await peer.do({ op: 'many', api: 'vmm', method: 'release', args: ids, parallel: 8 })).done).toBe(ids.length);
    }
    const journals = manager.names().filter((name) => /^j\d+$/.test(name));
    expect(journals).toHaveLength(1);
    expect(journals[0]).not.toBe('j1');
    await manager.kill();
    await peer.kill();
    peers.splice(0);
    await manager.start();
    const objects = (await call(manager.raw!.admin, 'ListObjects', {})).objects.filter((o: any) => o.kind === 'allocation').map((o: any) => o.id);
    expect(objects).toEqual([kept.id]);
  }, 300_000);

  it('closes a parked descriptor no record names, and keeps one journal', async () => {
    manager = new ServiceManagerStandIn();
    await manager.start();
    // A descriptor parked by a daemon that died before it wrote the record: a memfd under an unknown name.
    const orphan = addon.stateMemfdCreate('orphan');
    addon.unixDgramSendFds(manager.socketPath, Buffer.from('FDSTORE=1\nFDNAME=mzz'), [orphan]);
    addon.close(orphan);
    expect(manager.names()).toContain('mzz');
    await manager.kill();
    await manager.start();
    await eventually(() => (manager!.names().includes('mzz') ? undefined : true), 10_000, 'the orphan to be dropped');
    expect(manager.names().filter((name) => /^j\d+$/.test(name))).toHaveLength(1);
  }, 120_000);
});
