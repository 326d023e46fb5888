/**
 * The uid model of gRPC, attacked: a uid the
 * allow list refuses, and an allowed uid that is not an admin, call without
 * a session what acts daemon-wide or on root's objects (ClearCaches, the
 * listings, GetReport, Detach of root's stores, Fill of root's writable
 * store, 40 Creates against an 8 MiB quota); a session token used from
 * another uid; TCP without mutual TLS. Then what an allowed uid's session
 * may not do: act on the daemon's objects (an admin's, or what an ended
 * session left), or write another uid's writable store (through the daemon,
 * or through the descriptor of a read-only open). Peers of another uid need
 * root (CI runs as root); the TCP case runs anywhere. Larger with
 * VMMD_RELIABILITY=full.
 */
import * as grpc from '@grpc/grpc-js';
import { createHash } from 'node:crypto';
import { execFileSync, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect, VmmdClient } from '../../client';
import { call, eventually, MiB, objectsOf, packageRoot, Peer, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
// A uid that is neither root nor nobody, allowed through nobody's group: a store's maker that is not an admin.
const MAKER = 4242;
const CALLER = path.join(packageRoot(), 'dist', 'test', 'e2e', 'fixtures', 'raw-caller.js');
const SIZE = 2n * MiB;

type Outcome = { ok: true; response: any } | { ok: false; status: grpc.status; code: string; details: string };
type RawCall = { service: 'Devices' | 'VirtualMemory' | 'Stores' | 'Admin'; method: string; request: object; token?: string };

/** Makes the calls from a process of its own, as `as` (uid/gid) when given, on the Unix socket or over TCP. */
function rawCalls(calls: RawCall[], options: { dir?: string; as?: { uid: number; gid: number }; tcp?: { target: string; ca: string } }): Promise<Outcome[]> {
  return new Promise((resolve, reject) => {
    const env = {
      ...process.env,
      ...(options.dir === undefined ? {} : { VMMD_SOCKET_DIR: options.dir }),
      ...(options.tcp === undefined ? {} : { VMMD_TCP_TARGET: options.tcp.target, VMMD_TLS_CA: options.tcp.ca }),
    };
    const child = spawn(process.execPath, [CALLER], { stdio: ['pipe', 'pipe', 'pipe'], env, ...(options.as ?? {}) });
    let out = '';
    let err = '';
    child.stdout.on('data', (chunk) => (out += chunk));
    child.stderr.on('data', (chunk) => (err += chunk));
    child.on('exit', (code) => (code === 0 ? resolve(JSON.parse(out)) : reject(new Error(`raw-caller exited ${code}: ${err}`))));
    child.stdin.end(JSON.stringify(calls));
  });
}

/** What root holds: a session with a writable and a read-only store and a pending transfer, and a store handed to the daemon. */
async function rootHoldings(daemon: TestDaemon, root: VmmdClient) {
  const writable = await root.vmm.create({ size: SIZE });
  const frozen = await root.vmm.create({ size: SIZE });
  const rw = await root.stores.createStore({ allocationId: writable.id, name: 'root-rw' });
  const ro = await root.stores.createStore({ allocationId: frozen.id, name: 'root-ro', readOnly: true });
  const handed = await call(daemon.raw.stores, 'CreateStore', {
    allocationId: (await call(daemon.raw.vmm, 'Create', { size: String(SIZE) })).id,
    name: 'root-handed',
    handOver: true,
  });
  await root.stores.fill({ storeId: rw.id }, SIZE, 0x5a);
  return { stores: [rw, ro, handed] };
}

/** The attack on the uid model, as one list of calls. */
function attackCalls(stores: Array<{ id: string }>, creates: number): RawCall[] {
  return [
    { service: 'Admin', method: 'ClearCaches', request: {} },
    { service: 'Admin', method: 'GetReport', request: {} },
    ...stores.map((store): RawCall => ({ service: 'Stores', method: 'Detach', request: { store: { id: store.id } } })),
    { service: 'Stores', method: 'Fill', request: { target: { storeId: stores[0].id }, length: '4096', value: 0 } },
    ...Array.from({ length: creates }, (): RawCall => ({ service: 'VirtualMemory', method: 'Create', request: { size: String(SIZE) } })),
  ];
}

describe('the uid model of gRPC (host)', () => {
  const clients: VmmdClient[] = [];
  let daemon: TestDaemon | undefined;
  const figures: Record<string, Record<string, string | number | boolean>> = {};

  afterEach(async () => {
    for (const client of clients.splice(0)) client.close();
    await daemon?.stop();
    daemon = undefined;
  });
  afterAll(() => {
    for (const [name, values] of Object.entries(figures)) figure(`grpc-uids-${name}-host`, values);
  });

  async function rootClient(): Promise<VmmdClient> {
    const client = await connect({ socketDir: daemon!.dir });
    clients.push(client);
    return client;
  }

  /** Root's stores and bytes as they were: every store live, the writable one's bytes unchanged, the pending transfer still there. */
  async function expectRootIntact(root: VmmdClient, before: ReturnType<typeof objectsOf>, stores: Array<{ id: string }>) {
    expect(objectsOf(await daemon!.stats())).toEqual(before);
    const listed = (await root.stores.list()).filter((store) => stores.some((mine) => mine.id === store.id));
    expect(listed.map((store) => store.state)).toEqual(stores.map(() => 'STORE_STATE_LIVE'));
    expect((await root.stores.read({ storeId: stores[0].id }, 4096)).equals(Buffer.alloc(4096, 0x5a))).toBe(true);
  }

  (isRoot ? it : it.skip)('gives a uid the allow list refuses nothing on gRPC, with or without a session (run as root)', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--quota-per-uid', '8MiB']);
    const root = await rootClient();
    const { stores } = await rootHoldings(daemon, root);
    const fd = (await import('../../native')).addon.hostMemfdCreate('pending', SIZE);
    root.session.sendDescriptor(fd);
    (await import('../../native')).addon.close(fd);
    await new Promise((resolve) => setTimeout(resolve, 100));
    const before = objectsOf(await daemon.stats());
    const rounds = FULL ? 5 : 1;
    let tried = 0;
    const statuses: Record<string, number> = {};
    for (let round = 0; round < rounds; round++) {
      const calls: RawCall[] = [
        ...attackCalls(stores, 40),
        { service: 'Admin', method: 'ListSessions', request: {} },
        { service: 'Admin', method: 'ListObjects', request: {} },
        { service: 'Stores', method: 'List', request: {} },
        { service: 'Devices', method: 'ListDevices', request: {} },
        // Root's token, from another uid: refused whatever it names.
        { service: 'Admin', method: 'ListObjects', request: {}, token: root.session.token },
        { service: 'Stores', method: 'Detach', request: { store: { id: stores[0].id } }, token: root.session.token },
      ];
      const outcomes = await rawCalls(calls, { dir: daemon.dir, as: { uid: NOBODY, gid: NOBODY } });
      for (const outcome of outcomes) {
        tried++;
        expect(outcome).toMatchObject({
          ok: false,
          status: grpc.status.PERMISSION_DENIED,
          code: 'NOT_ALLOWED',
          details: expect.stringMatching(/uid 65534 \(gid 65534\) is not allowed/),
        });
        statuses[(outcome as { code: string }).code] = (statuses[(outcome as { code: string }).code] ?? 0) + 1;
      }
    }
    await expectRootIntact(root, before, stores);
    expect((await daemon.stats()).pendingTransfers).toBe(1);
    figures['not-allowed'] = { tried, refused: tried, ...statuses, leaked: 0 };
  });

  (isRoot ? it : it.skip)(
    'lets an allowed uid that is not an admin inspect its own, and touch nothing of root: no daemon-wide calls, no borrowed token (run as root)',
    async () => {
      daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY), '--quota-per-uid', '8MiB']);
      const root = await rootClient();
      const { stores } = await rootHoldings(daemon, root);
      const before = objectsOf(await daemon.stats());
      const rounds = FULL ? 5 : 1;
      let tried = 0;
      const statuses: Record<string, number> = {};
      const count = (code: string) => (statuses[code] = (statuses[code] ?? 0) + 1);
      for (let round = 0; round < rounds; round++) {
        const attack = attackCalls(stores, 40);
        const outcomes = await rawCalls(
          [
            ...attack,
            { service: 'Admin', method: 'ListSessions', request: {} },
            { service: 'Admin', method: 'ListObjects', request: {} },
            { service: 'Admin', method: 'ListObjects', request: {}, token: root.session.token },
            { service: 'VirtualMemory', method: 'Create', request: { size: String(SIZE) }, token: root.session.token },
          ],
          { dir: daemon.dir, as: { uid: NOBODY, gid: NOBODY } },
        );
        // Daemon-wide, and everything without a session that changes anything: an admin's.
        for (const outcome of outcomes.slice(0, attack.length)) {
          tried++;
          expect(outcome).toMatchObject({ ok: false, status: grpc.status.PERMISSION_DENIED, code: 'NEEDS_ADMIN' });
          count('NEEDS_ADMIN');
        }
        // The listings show it nothing of root's.
        const [sessions, objects, ...borrowed] = outcomes.slice(attack.length);
        expect(sessions).toEqual({ ok: true, response: { sessions: [] } });
        expect(objects).toEqual({ ok: true, response: { objects: [] } });
        for (const outcome of borrowed) {
          tried++;
          expect(outcome).toMatchObject({ ok: false, status: grpc.status.PERMISSION_DENIED, code: 'SESSION_OF_ANOTHER_UID' });
          count('SESSION_OF_ANOTHER_UID');
        }
      }
      // With a session of its own, it detaches neither root's session stores nor the one root handed to the daemon.
      const other = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
      try {
        for (const store of stores) {
          tried++;
          await expect(other.do({ op: 'call', api: 'stores', method: 'detach', args: { id: store.id } })).rejects.toMatchObject({ code: 'NOT_OWNER' });
          count('NOT_OWNER');
        }
        // Its own memory it makes and is charged for: 4 of 2 MiB against 8 MiB, the 5th refused.
        for (let i = 0; i < 4; i++) await other.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(SIZE) } });
        tried++;
        await expect(other.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(SIZE) } })).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED' });
        count('QUOTA_EXCEEDED');
        // What it lists is its own.
        const listed = await rawCalls([{ service: 'Admin', method: 'ListSessions', request: {} }], { dir: daemon.dir, as: { uid: NOBODY, gid: NOBODY } });
        expect((listed[0] as { response: { sessions: Array<{ uid: number }> } }).response.sessions.map((session) => session.uid)).toEqual([NOBODY]);
      } finally {
        await other.stop();
      }
      await new Promise((resolve) => setTimeout(resolve, 200));
      await expectRootIntact(root, before, stores);
      figures['not-admin'] = { tried, refused: tried, ...statuses, leaked: 0 };
    },
  );

  (isRoot ? it : it.skip)("keeps the daemon's objects to admins: a session of an allowed uid that is not one acts on none of them (run as root)", async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY)]);
    const vmm = daemon.raw.vmm;
    // The daemon's: an admin's objects made without a session (an allocation mapped with access in a reservation,
    // another allocation, an empty reservation) ...
    const mapped = await call(vmm, 'Create', { size: String(SIZE) });
    const reservation = await call(vmm, 'Reserve', { size: String(SIZE) });
    await call(vmm, 'Map', { address: reservation.address, size: String(SIZE), offset: '0', allocationId: mapped.id });
    const readWrite = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];
    await call(vmm, 'SetAccess', { address: reservation.address, size: String(SIZE), descriptors: readWrite });
    const loose = await call(vmm, 'Create', { size: String(SIZE) });
    const empty = await call(vmm, 'Reserve', { size: String(SIZE) });
    // ... and an allocation a session left behind: its store, handed to the daemon, still holds it.
    const leaver = await connect({ socketDir: daemon.dir });
    const left = await leaver.vmm.create({ size: SIZE });
    await leaver.stores.createStore({ allocationId: left.id, name: 'left-behind', handOver: true });
    leaver.close();
    await eventually(
      async () => ((await call(vmm, 'GetProperties', { allocationId: String(left.id) })).ownerSession === '0' ? true : undefined),
      10_000,
      'the left allocation to be the daemon’s',
    );
    // The attacker: an allowed uid (nobody's group) with a session of its own and an allocation of its own.
    const attacker = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
    try {
      const own = await attacker.do<{ id: string }>({ op: 'call', api: 'vmm', method: 'create', args: { size: String(SIZE) } });
      const token = await attacker.do<string>({ op: 'token' });
      const before = objectsOf(await daemon.stats());
      const rounds = FULL ? 5 : 1;
      let tried = 0;
      for (let round = 0; round < rounds; round++) {
        const onAllocation = (id: string): RawCall[] => [
          { service: 'VirtualMemory', method: 'Release', request: { allocationId: id }, token },
          { service: 'VirtualMemory', method: 'Share', request: { allocationId: id }, token },
          { service: 'VirtualMemory', method: 'Export', request: { allocationId: id, handleType: 'HANDLE_TYPE_POSIX_FD' }, token },
          { service: 'Stores', method: 'CreateStore', request: { allocationId: id, name: `taken-${id}-${round}` }, token },
        ];
        const calls: RawCall[] = [
          ...onAllocation(String(mapped.id)),
          ...onAllocation(String(loose.id)),
          ...onAllocation(String(left.id)),
          { service: 'VirtualMemory', method: 'Map', request: { address: empty.address, size: String(SIZE), offset: '0', allocationId: own.id }, token },
          { service: 'VirtualMemory', method: 'FreeAddress', request: { address: empty.address, size: String(SIZE) }, token },
          { service: 'VirtualMemory', method: 'Unmap', request: { address: reservation.address, size: String(SIZE) }, token },
          { service: 'VirtualMemory', method: 'SetAccess', request: { address: reservation.address, size: String(SIZE), descriptors: readWrite }, token },
          { service: 'VirtualMemory', method: 'RetainHandle', request: { address: reservation.address }, token },
          { service: 'Stores', method: 'Fill', request: { span: { address: reservation.address }, length: '4096', value: 1 }, token },
        ];
        const outcomes = await rawCalls(calls, { dir: daemon.dir, as: { uid: NOBODY, gid: NOBODY } });
        outcomes.forEach((outcome, i) => {
          tried++;
          expect({ call: `${calls[i].service}.${calls[i].method}`, outcome }).toMatchObject({
            outcome: { ok: false, status: grpc.status.PERMISSION_DENIED, code: 'NOT_OWNER', details: expect.stringMatching(/belongs to the daemon/) },
          });
        });
      }
      expect(objectsOf(await daemon.stats())).toEqual(before);
      // An admin's session may: root shares one of the daemon's allocations.
      const admin = await rootClient();
      expect((await admin.vmm.share({ allocationId: loose.id })).shareKey).toBeTruthy();
      figures['daemon-objects'] = { tried, refused: tried, NOT_OWNER: tried, leaked: 0 };
    } finally {
      await attacker.stop();
    }
  });

  (isRoot ? it : it.skip)(
    'keeps a writable store to the uid that made it and admins: another uid reads it and opens it read-only only (run as root)',
    async () => {
      daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY)]);
      // The maker: a uid that is not an admin, with the store; another session of the same uid may write it too.
      const maker = await Peer.start(daemon.dir, { uid: MAKER, gid: NOBODY });
      const makerAgain = await Peer.start(daemon.dir, { uid: MAKER, gid: NOBODY });
      const attacker = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
      try {
        const allocation = await maker.do<{ id: string }>({ op: 'call', api: 'vmm', method: 'create', args: { size: String(SIZE) } });
        const store = await maker.do<{ id: string }>({
          op: 'call',
          api: 'stores',
          method: 'createStore',
          args: { allocationId: allocation.id, name: 'maker-rw' },
        });
        const makerToken = await maker.do<string>({ op: 'token' });
        const [filled] = await rawCalls(
          [{ service: 'Stores', method: 'Fill', request: { span: { storeId: store.id }, length: String(SIZE), value: 0x5a }, token: makerToken }],
          {
            dir: daemon.dir,
            as: { uid: MAKER, gid: NOBODY },
          },
        );
        expect(filled).toMatchObject({ ok: true });
        const attackerToken = await attacker.do<string>({ op: 'token' });
        const own = await attacker.do<{ id: string }>({ op: 'call', api: 'vmm', method: 'create', args: { size: String(SIZE) } });
        const ownStore = await attacker.do<{ id: string }>({
          op: 'call',
          api: 'stores',
          method: 'createStore',
          args: { allocationId: own.id, name: 'attacker-own' },
        });
        const rounds = FULL ? 5 : 1;
        let tried = 0;
        const statuses: Record<string, number> = {};
        for (let round = 0; round < rounds; round++) {
          const calls: RawCall[] = [
            { service: 'Stores', method: 'Fill', request: { span: { storeId: store.id }, length: '4096', value: 1 }, token: attackerToken },
            {
              service: 'Stores',
              method: 'Fill',
              request: { span: { storeId: store.id, offset: String(SIZE - 4096n) }, length: '4096', value: 1 },
              token: attackerToken,
            },
            {
              service: 'Stores',
              method: 'Copy',
              request: { source: { storeId: ownStore.id }, target: { storeId: store.id }, length: '4096' },
              token: attackerToken,
            },
            {
              service: 'Stores',
              method: 'Copy',
              request: { source: { storeId: store.id }, target: { storeId: store.id, offset: '4096' }, length: '4096' },
              token: attackerToken,
            },
            { service: 'Stores', method: 'Open', request: { store: { id: store.id }, writable: true }, token: attackerToken },
            { service: 'Stores', method: 'Open', request: { store: { name: 'maker-rw' }, writable: true }, token: attackerToken },
          ];
          const outcomes = await rawCalls(calls, { dir: daemon.dir, as: { uid: NOBODY, gid: NOBODY } });
          outcomes.forEach((outcome, i) => {
            tried++;
            expect({ call: `${calls[i].service}.${calls[i].method}`, outcome }).toMatchObject({
              outcome: {
                ok: false,
                status: grpc.status.PERMISSION_DENIED,
                code: 'NOT_STORE_WRITER',
                details: expect.stringMatching(new RegExp(`store ${store.id} is written only by uid ${MAKER}`)),
              },
            });
            statuses.NOT_STORE_WRITER = (statuses.NOT_STORE_WRITER ?? 0) + 1;
          });
          // Write (a client stream), through its own client library.
          tried++;
          await expect(attacker.do({ op: 'storeWrite', id: store.id, text: 'attack' })).rejects.toMatchObject({ code: 'NOT_STORE_WRITER' });
          statuses.NOT_STORE_WRITER++;
          // Opened read-only, the descriptor it gets cannot write the memory either (host: it is open O_RDONLY).
          tried++;
          const raw = await attacker.do<{ write: string; writableMapping: string; readOnlyMapping: string }>({ op: 'storeOpenRaw', id: store.id });
          expect(raw).toEqual({ write: 'EBADF', writableMapping: 'EACCES', readOnlyMapping: 'ok' });
          statuses.readOnlyDescriptor = (statuses.readOnlyDescriptor ?? 0) + 1;
          // Again after the maker opened it writable: the store hands out dups of the read-only descriptor it kept, never the writable one.
          await maker.do({ op: 'storeClose', handle: (await maker.do<{ handle: number }>({ op: 'storeOpen', name: 'maker-rw', writable: true })).handle });
          tried++;
          expect(await attacker.do({ op: 'storeOpenRaw', id: store.id })).toEqual({ write: 'EBADF', writableMapping: 'EACCES', readOnlyMapping: 'ok' });
          statuses.readOnlyDescriptor++;
        }
        // It reads the store (open read-only, and through the daemon): that is what others may.
        const opened = await attacker.do<{ handle: number }>({ op: 'storeOpen', name: 'maker-rw' });
        const sum = await attacker.do<{ sha256: string }>({ op: 'storeChecksum', handle: opened.handle });
        expect(sum.sha256).toBe(
          createHash('sha256')
            .update(Buffer.alloc(Number(SIZE), 0x5a))
            .digest('hex'),
        );
        await attacker.do({ op: 'storeClose', handle: opened.handle });
        // The maker's uid writes it from another session, and an admin (root, here without a session) may too.
        const [again] = await rawCalls(
          [
            {
              service: 'Stores',
              method: 'Fill',
              request: { span: { storeId: store.id }, length: '4096', value: 0x5a },
              token: await makerAgain.do<string>({ op: 'token' }),
            },
          ],
          {
            dir: daemon.dir,
            as: { uid: MAKER, gid: NOBODY },
          },
        );
        expect(again).toMatchObject({ ok: true });
        await call(daemon.raw.stores, 'Fill', { span: { storeId: store.id }, length: '4096', value: 0x5a });
        // Unchanged by the attacker.
        const check = await maker.do<{ handle: number }>({ op: 'storeOpen', name: 'maker-rw' });
        expect((await maker.do<{ sha256: string }>({ op: 'storeChecksum', handle: check.handle })).sha256).toBe(sum.sha256);
        await maker.do({ op: 'storeClose', handle: check.handle });
        figures['store-writers'] = { tried, refused: tried, ...statuses, leaked: 0 };
      } finally {
        await attacker.stop();
        await makerAgain.stop();
        await maker.stop();
      }
    },
  );

  it('serves TCP without a client certificate public inspection only', async () => {
    const certs = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-tls-'));
    const file = (name: string) => path.join(certs, name);
    try {
      const run = (...args: string[]) => execFileSync('openssl', args, { stdio: 'ignore' });
      run(
        'req',
        '-x509',
        '-newkey',
        'rsa:2048',
        '-nodes',
        '-days',
        '1',
        '-subj',
        '/CN=localhost',
        '-addext',
        'subjectAltName=DNS:localhost,IP:127.0.0.1',
        '-keyout',
        file('server.key'),
        '-out',
        file('server.pem'),
      );
      const port = 20000 + Math.floor(Math.random() * 20000);
      daemon = await TestDaemon.start([
        '--tcp-listen',
        `127.0.0.1:${port}`,
        '--tls-cert',
        file('server.pem'),
        '--tls-key',
        file('server.key'),
        '--quota-per-uid',
        '8MiB',
      ]);
      const root = await rootClient();
      const { stores } = await rootHoldings(daemon, root);
      const before = objectsOf(await daemon.stats());
      const tcp = { target: `localhost:${port}`, ca: file('server.pem') };
      const attack: RawCall[] = [
        ...attackCalls(stores, 40),
        { service: 'Admin', method: 'ListSessions', request: {} },
        { service: 'Admin', method: 'ListObjects', request: {} },
        { service: 'Stores', method: 'List', request: {} },
      ];
      const outcomes = await rawCalls(
        [...attack, { service: 'Devices', method: 'ListDevices', request: {} }, { service: 'Admin', method: 'GetStats', request: {} }],
        { tcp },
      );
      for (const outcome of outcomes.slice(0, attack.length)) {
        expect(outcome).toMatchObject({ ok: false, status: grpc.status.PERMISSION_DENIED, code: 'TCP_INSPECTION_ONLY' });
      }
      expect(outcomes.slice(attack.length).every((outcome) => outcome.ok)).toBe(true);
      await expectRootIntact(root, before, stores);
      figures['tcp-without-mutual-tls'] = {
        tried: attack.length,
        refused: attack.length,
        TCP_INSPECTION_ONLY: attack.length,
        publicInspectionServed: 2,
        leaked: 0,
      };
    } finally {
      fs.rmSync(certs, { recursive: true, force: true });
    }
  });
});
