/**
 * Security, as an attacker with a session of its own would try it, on either
 * backend: every touch of another session's objects, replayed and guessed
 * transfer ids, every path that could write a read-only store, and quotas
 * under concurrent requests over both the RPC and the session socket. Each
 * attempt is counted; the figures are reported at the end (test/reliability).
 */
import * as grpc from '@grpc/grpc-js';
import { createHash, randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { LocalDeviceMemory } from '../../client/shared-memory';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { addon, HOST_ACCESS } from '../../native';
import { call, eventually, MiB, objectsOf, stopWhenClean, TestDaemon } from '../e2e/harness';
import { figure } from '../reliability/figures';

type Backend = 'host' | 'cuda';
const SIZE = 2n * MiB;
const access = (flags: AccessDescriptor['flags']): AccessDescriptor[] => [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags }];

/** Every attempt, by what it tried and how it was refused. */
class Tally {
  attempts = 0;
  readonly statuses: Record<string, number> = {};

  /** The attempt must fail with one of `statuses` (and `code`, when given); it is counted. */
  async refused(attempt: () => Promise<unknown>, statuses: grpc.status[], code?: string | RegExp): Promise<void> {
    this.attempts++;
    const error: { status?: grpc.status; code?: unknown; message: string } = await attempt().then(
      () => new Error('the attempt succeeded'),
      (caught: unknown) => caught as { status?: grpc.status; code?: unknown; message: string },
    );
    expect(error.message).not.toBe('the attempt succeeded');
    // The client library's VmmdError has status and code; a raw grpc-js error has the status as code.
    const status = error.status ?? (typeof error.code === 'number' ? error.code : undefined);
    expect(statuses).toContain(status);
    if (code !== undefined) expect(String(error.code)).toMatch(code);
    const name = grpc.status[status!];
    this.statuses[name] = (this.statuses[name] ?? 0) + 1;
  }
}

/** A system call of this process as an attempt: the kernel's refusal (errno in code) counts as PERMISSION_DENIED. */
const deniedBy = (syscall: () => unknown) => async () => {
  try {
    syscall();
  } catch (error) {
    throw Object.assign(error as Error, { status: grpc.status.PERMISSION_DENIED });
  }
};

const checksum = (data: Buffer) => createHash('sha256').update(data).digest('hex');

export function securityContract(backend: Backend, options: { full: boolean }): void {
  let daemon: TestDaemon | undefined;
  const clients: VmmdClient[] = [];
  const figures: Record<string, Record<string, string | number | boolean>> = {};

  async function client(): Promise<VmmdClient> {
    const connected = await connect({ socketDir: daemon!.dir });
    clients.push(connected);
    return connected;
  }

  afterEach(async () => {
    await stopWhenClean(daemon, clients);
    daemon = undefined;
  });

  afterAll(() => {
    for (const [name, values] of Object.entries(figures)) figure(`security-${name}-${backend}`, { backend, ...values });
  });

  /** A's memory: an allocation mapped with a pattern, another unmapped, a store of the first, an attached store, a pending transfer. */
  async function victim(a: VmmdClient) {
    const mapped = await a.vmm.create({ size: SIZE });
    const unmapped = await a.vmm.create({ size: SIZE });
    const { address } = await a.vmm.reserve({ size: SIZE });
    await a.vmm.map({ address, size: SIZE, allocationId: mapped.id });
    await a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
    const pattern = randomBytes(Number(SIZE));
    await a.vmm.write(address, pattern);
    const store = await a.stores.createStore({ allocationId: mapped.id });
    const fd = addon.hostMemfdCreate('victim', SIZE);
    const attached = await a.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false });
    const transferId = a.session.sendDescriptor(fd);
    addon.close(fd);
    await eventually(async () => ((await daemon!.stats()).pendingTransfers === 1 ? true : undefined));
    return { mapped, unmapped, address, store, attached, transferId, checksum: checksum(pattern) };
  }

  it("refuses a session every touch of another session's objects, and A's memory is as it was", async () => {
    daemon = await TestDaemon.start(['--transfer-wait-ms', '100', ...(backend === 'cuda' ? ['--stock', 'none'] : [])], backend);
    const a = await client();
    const b = await client();
    const v = await victim(a);
    const tally = new Tally();
    const DENIED = [grpc.status.PERMISSION_DENIED];
    const { address } = v;
    const { address: mine } = await b.vmm.reserve({ size: SIZE });
    const before = await daemon.stats();
    const rounds = options.full ? 5 : 1;
    for (let round = 0; round < rounds; round++) {
      await tally.refused(() => b.vmm.read(address, 4), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.read(address, Number(SIZE)), DENIED, 'NOT_OWNER'); // the staged path
      await tally.refused(() => b.vmm.readInto(address, Buffer.alloc(Number(MiB))), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.write(address, Buffer.from('x')), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.write(address, Buffer.alloc(Number(MiB), 1)), DENIED, 'NOT_OWNER'); // staged
      await tally.refused(() => b.vmm.unmap({ address, size: SIZE }), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.freeAddress({ address, size: SIZE }), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') }), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_NONE') }), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.retainHandle({ address }), DENIED, 'NOT_OWNER');
      await tally.refused(() => b.vmm.getAccess({ address, location: { type: 'LOCATION_TYPE_DEVICE', id: 0 } }), DENIED, 'NOT_OWNER');
      for (const allocation of [v.mapped.id, v.unmapped.id]) {
        await tally.refused(() => b.vmm.getProperties({ allocationId: allocation }), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.vmm.release({ allocationId: allocation }), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.vmm.export({ allocationId: allocation }), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.vmm.export({ allocationId: allocation, shareKey: randomBytes(32).toString('hex') }), DENIED, 'BAD_SHARE_KEY');
        await tally.refused(() => b.vmm.share({ allocationId: allocation }), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.vmm.import(allocation), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.vmm.map({ address: mine, size: SIZE, allocationId: allocation }), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.stores.createStore({ allocationId: allocation }), DENIED, 'NOT_OWNER');
      }
      for (const store of [v.store, v.attached]) {
        await tally.refused(() => b.stores.detach(BigInt(store.id)), DENIED, 'NOT_OWNER');
        await tally.refused(() => b.stores.close(store.id), [grpc.status.FAILED_PRECONDITION], 'NOT_OPEN');
      }
      await tally.refused(() => b.vmm.importTransfer({ transferId: v.transferId }), [grpc.status.DEADLINE_EXCEEDED], 'TRANSFER_NOT_RECEIVED');
      // A's token is A's: B cannot borrow it without knowing it, and guesses are refused.
      const guess = new grpc.Metadata();
      guess.set(SESSION_METADATA_KEY, randomBytes(32).toString('hex'));
      await tally.refused(() => call(daemon!.raw.vmm, 'Unmap', { address: String(address), size: String(SIZE) }, guess), [grpc.status.UNAUTHENTICATED]);
    }
    expect(objectsOf(await daemon.stats())).toEqual(objectsOf(before));
    expect(checksum(await a.vmm.read(address, Number(SIZE)))).toBe(v.checksum);
    expect((await a.vmm.getAccess({ address, location: { type: 'LOCATION_TYPE_DEVICE', id: 0 } })).flags).toBe('ACCESS_FLAGS_READWRITE');
    expect(tally.attempts).toBe(rounds * 33);
    figures.isolation = { attempts: tally.attempts, refused: tally.attempts, ...tally.statuses, victimChecksumIntact: true };
  });

  it('uses transfer ids once, for their own session only: replays and guesses are refused', async () => {
    daemon = await TestDaemon.start(['--transfer-wait-ms', '50', ...(backend === 'cuda' ? ['--stock', 'none'] : [])], backend);
    const a = await client();
    const b = await client();
    const tally = new Tally();
    // Memory of the backend's kind: a memfd, or CUDA memory this process made.
    const local = backend === 'cuda' ? await LocalDeviceMemory.allocate(0, SIZE) : undefined;
    const fd = local !== undefined ? await local.exportFd() : addon.hostMemfdCreate('transfer', SIZE);
    const first = a.session.sendDescriptor(fd);
    await eventually(async () => ((await daemon!.stats()).pendingTransfers === 1 ? true : undefined));
    await tally.refused(() => b.vmm.importTransfer({ transferId: first }), [grpc.status.DEADLINE_EXCEEDED], 'TRANSFER_NOT_RECEIVED');
    const imported = await a.vmm.importTransfer({ transferId: first, size: SIZE });
    await tally.refused(() => a.vmm.importTransfer({ transferId: first }), [grpc.status.FAILED_PRECONDITION], 'TRANSFER_USED');
    await tally.refused(() => b.vmm.importTransfer({ transferId: first }), [grpc.status.DEADLINE_EXCEEDED, grpc.status.FAILED_PRECONDITION]);
    // Transfer ids are numbered per session: another session's id names nothing of its owner's.
    // A transfer of a session that ended goes with it.
    const c = await client();
    const orphan = c.session.sendDescriptor(fd);
    await eventually(async () => ((await daemon!.stats()).pendingTransfers === 1 ? true : undefined));
    c.close();
    await eventually(async () => ((await daemon!.stats()).pendingTransfers === 0 ? true : undefined), 10_000, 'the transfer to go with its session');
    await tally.refused(() => a.vmm.importTransfer({ transferId: orphan }), [grpc.status.DEADLINE_EXCEEDED, grpc.status.FAILED_PRECONDITION]);
    // Guessed ids: numbers near the real ones, and random ones.
    const guesses = options.full ? 200 : 40;
    const near = BigInt(orphan);
    for (let i = 0; i < guesses; i++) {
      const transferId = i % 2 === 0 ? String(near + BigInt(i / 2 + 1)) : BigInt.asUintN(64, BigInt(`0x${randomBytes(8).toString('hex')}`)).toString();
      await tally.refused(
        () => (i % 4 < 2 ? a : b).vmm.importTransfer({ transferId }),
        [grpc.status.DEADLINE_EXCEEDED, grpc.status.FAILED_PRECONDITION, grpc.status.INVALID_ARGUMENT],
      );
    }
    addon.close(fd);
    await a.vmm.release({ allocationId: imported.id });
    await local?.free();
    expect((await daemon.stats()).pendingTransfers).toBe(0);
    figures.transfers = { attempts: tally.attempts, refused: tally.attempts, claimedByTheirOwner: 1, ...tally.statuses };
  });

  it('lets nothing write a read-only store: not the daemon, not an open, not the memory behind it', async () => {
    daemon = await TestDaemon.start(backend === 'cuda' ? ['--stock', 'none'] : [], backend);
    const a = await client();
    const b = await client();
    const tally = new Tally();
    const READ_ONLY = [grpc.status.FAILED_PRECONDITION];
    const allocation = await a.vmm.create({ size: SIZE });
    const { address } = await a.vmm.reserve({ size: SIZE });
    await a.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    await a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
    const pattern = randomBytes(Number(SIZE));
    await a.vmm.write(address, pattern);
    // Made read-only once nothing the daemon maps writes it (else WRITABLE_MAPPINGS: the next test).
    await a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READ') });
    const store = await a.stores.createStore({ allocationId: allocation.id, readOnly: true, name: 'frozen' });
    const other = await a.stores.createStore({ allocationId: (await a.vmm.create({ size: SIZE })).id, name: 'source' });
    const fd = addon.hostMemfdCreate('frozen-attached', SIZE);
    const attached = await a.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: true, name: 'frozen-attached' });
    for (const who of [a, b]) {
      for (const target of [store, attached]) {
        await tally.refused(() => who.stores.write({ storeId: target.id }, Buffer.from('x')), READ_ONLY, 'STORE_READ_ONLY');
        await tally.refused(() => who.stores.write({ storeId: target.id, offset: 4096n }, Buffer.alloc(Number(MiB), 1)), READ_ONLY, 'STORE_READ_ONLY');
        await tally.refused(() => who.stores.fill({ storeId: target.id }, 4096, 0xff), READ_ONLY, 'STORE_READ_ONLY');
        await tally.refused(() => who.stores.copy({ storeId: other.id }, { storeId: target.id }, 4096), READ_ONLY, 'STORE_READ_ONLY');
        await tally.refused(() => who.stores.open({ id: target.id }, { writable: true }), READ_ONLY, 'STORE_READ_ONLY');
      }
    }
    // The memory behind the store, through the daemon, even for its owner.
    await tally.refused(() => a.vmm.write(address, Buffer.from('x')), READ_ONLY, 'READ_ONLY_MEMORY');
    await tally.refused(() => a.vmm.write(address, Buffer.alloc(Number(MiB), 1)), READ_ONLY, 'READ_ONLY_MEMORY'); // staged
    await tally.refused(() => a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') }), READ_ONLY, 'READ_ONLY_MEMORY');
    const { address: again } = await a.vmm.reserve({ size: SIZE });
    await a.vmm.map({ address: again, size: SIZE, allocationId: allocation.id });
    await tally.refused(() => a.vmm.setAccess({ address: again, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') }), READ_ONLY, 'READ_ONLY_MEMORY');
    await a.vmm.setAccess({ address: again, size: SIZE, descriptors: access('ACCESS_FLAGS_READ') });
    if (backend === 'host') {
      // The descriptors handed out are sealed: no writable mapping, no write(2), whoever holds them.
      const key = (await a.vmm.share({ allocationId: allocation.id })).shareKey;
      await tally.refused(() => b.vmm.import(allocation.id, { shareKey: key }), [grpc.status.PERMISSION_DENIED], 'LOCAL_MAP_FAILED');
      const metadata = new grpc.Metadata();
      metadata.set(SESSION_METADATA_KEY, b.session.token);
      for (const target of [store, attached]) {
        const opened = await call(daemon.raw.stores, 'Open', { store: { id: target.id }, writable: false }, metadata);
        const raw = await b.session.takeTransfer(opened.transferId);
        try {
          await tally.refused(
            deniedBy(() => fs.writeSync(raw, Buffer.from('x'), 0, 1, 0)),
            [grpc.status.PERMISSION_DENIED],
            'EPERM',
          );
          const page = BigInt(addon.pageSize());
          const at = addon.hostReserve(SIZE, page, 0n);
          try {
            addon.hostMap(at, SIZE, raw, 0n);
            await tally.refused(
              deniedBy(() => addon.hostProtect(at, SIZE, HOST_ACCESS.READWRITE)),
              [grpc.status.PERMISSION_DENIED],
              /EPERM|EACCES/,
            );
          } finally {
            addon.hostUnmap(at, SIZE);
            addon.hostFreeAddress(at, SIZE);
          }
        } finally {
          addon.close(raw);
        }
        await call(daemon.raw.stores, 'Close', { storeId: target.id }, metadata);
      }
    }
    // Opened read-only, both stores read back what was there.
    const opened = await b.stores.open({ id: store.id });
    expect(checksum(await b.stores.read({ storeId: store.id }, SIZE))).toBe(checksum(pattern));
    await opened.close();
    expect(checksum(await a.vmm.read(address, Number(SIZE)))).toBe(checksum(pattern));
    expect((await b.stores.read({ storeId: attached.id }, 4096)).equals(Buffer.alloc(4096))).toBe(true);
    addon.close(fd);
    figures['read-only'] = { attempts: tally.attempts, refused: tally.attempts, ...tally.statuses, contentIntact: true, kernelSeal: backend === 'host' };
  });

  it('refuses a read-only store of memory the daemon maps writable, naming each mapping', async () => {
    daemon = await TestDaemon.start(backend === 'cuda' ? ['--stock', 'none'] : [], backend);
    const a = await client();
    const tally = new Tally();
    const WRITABLE = [grpc.status.FAILED_PRECONDITION];
    const allocation = await a.vmm.create({ size: SIZE });
    const { address } = await a.vmm.reserve({ size: SIZE });
    await a.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    await a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
    await a.vmm.write(address, Buffer.from('before'));
    const makeReadOnly = () => a.stores.createStore({ allocationId: allocation.id, readOnly: true, name: 'frozen' });
    const rounds = options.full ? 5 : 1;
    for (let round = 0; round < rounds; round++) {
      // The session's own mapping with READWRITE access, made before: refused, and named.
      await tally.refused(makeReadOnly, WRITABLE, 'WRITABLE_MAPPINGS');
      await expect(makeReadOnly()).rejects.toThrow(`[0x${BigInt(address).toString(16)}, 0x${(BigInt(address) + SIZE).toString(16)}) of session `);
      // A writable store of it: the daemon maps it writable for the store, and its opens may be mapped writable.
      await a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READ') });
      const writable = await a.stores.createStore({ allocationId: allocation.id, name: 'writable' });
      await tally.refused(makeReadOnly, WRITABLE, 'WRITABLE_MAPPINGS');
      await expect(makeReadOnly()).rejects.toThrow(/of the daemon \(a writable store of it\)/);
      await a.stores.detach({ id: writable.id });
      if (round < rounds - 1) await a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
    }
    expect((await a.stores.list()).filter((store) => store.state === 'STORE_STATE_LIVE')).toHaveLength(0);
    // Nothing the daemon maps writes it any more: the store is made, with the bytes as they were, and stays read-only.
    const store = await makeReadOnly();
    expect((await a.stores.read({ storeId: store.id }, 6)).toString()).toBe('before');
    await tally.refused(() => a.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') }), WRITABLE, 'READ_ONLY_MEMORY');
    await a.stores.detach({ id: store.id });
    await a.vmm.unmap({ address, size: SIZE });
    await a.vmm.freeAddress({ address, size: SIZE });
    await a.vmm.release({ allocationId: allocation.id });
    figures['read-only-writable-mappings'] = { attempts: tally.attempts, refused: tally.attempts, ...tally.statuses, contentIntact: true };
  });

  it('holds quotas under concurrent requests on the RPC and the session socket, per session and per uid', async () => {
    daemon = await TestDaemon.start(['--quota-per-session', '8MiB', '--quota-per-uid', '24MiB', ...(backend === 'cuda' ? ['--stock', 'none'] : [])], backend);
    const sessions = await Promise.all(Array.from({ length: 6 }, () => client()));
    const rounds = options.full ? 10 : 3;
    let requests = 0;
    let granted = 0;
    let refused = 0;
    for (let round = 0; round < rounds; round++) {
      const results = await Promise.all(
        sessions.map(async (session, index) => {
          // Three ways in, interleaved: Create and Allocate over gRPC, allocate on the session socket.
          const outcomes = await Promise.allSettled(
            Array.from({ length: 8 }, async (_, i): Promise<{ id: string; close?: () => Promise<void> | void }> => {
              const way = (i + index) % 3;
              if (way === 0) return { id: (await session.vmm.create({ size: SIZE })).id };
              if (way === 1) {
                const made = await session.vmm.allocateRaw({ size: SIZE });
                addon.close(await session.session.takeTransfer(made.transferId));
                return { id: made.allocationId };
              }
              const memory = await session.vmm.allocate({ size: SIZE });
              return { id: String(memory.allocationId), close: () => memory.close() };
            }),
          );
          return { session, outcomes };
        }),
      );
      let grantedThisRound = 0;
      for (const { outcomes } of results) {
        const mine = outcomes.filter((outcome) => outcome.status === 'fulfilled').length;
        expect(mine).toBeLessThanOrEqual(4);
        grantedThisRound += mine;
        for (const outcome of outcomes) {
          if (outcome.status === 'rejected') expect(outcome.reason).toMatchObject({ code: 'QUOTA_EXCEEDED', status: grpc.status.RESOURCE_EXHAUSTED });
        }
      }
      requests += 48;
      // 6 sessions want 16 MiB each: the uid's 24 MiB is granted exactly, never more.
      expect(grantedThisRound).toBe(12);
      expect(BigInt((await daemon.stats()).allocatedBytes)).toBe(24n * MiB);
      granted += grantedThisRound;
      refused += 48 - grantedThisRound;
      for (const { session, outcomes } of results) {
        for (const outcome of outcomes) {
          if (outcome.status !== 'fulfilled') continue;
          await outcome.value.close?.();
          await session.vmm.release({ allocationId: outcome.value.id });
        }
      }
    }
    figures.quotas = { rounds, requests, granted, refused, sessions: 6, perSessionLimitMiB: 8, perUidLimitMiB: 24, overshoots: 0 };
  });
}
