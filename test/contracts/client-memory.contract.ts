/**
 * Client memory the daemon maps, attacked as a hostile client would, on either
 * backend: memfds shrunk under the daemon after it mapped them (SIGBUS for
 * the whole daemon in 0.1.0), and descriptors whose access mode or seals
 * forbid the mapping asked for (INTERNAL in 0.1.0). Each attempt must end in
 * a precise refusal at the call that hands the descriptor over, or in the
 * kernel refusing the shrink; the daemon stays alive and serving, its
 * objects and descriptors back where they were, another session's memory as
 * it was. Import of a memfd is the host backend's (cuda imports CUDA memory).
 */
import * as grpc from '@grpc/grpc-js';
import { createHash, randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { addon, MEMFD_SEALS } from '../../native';
import { call, eventually, MiB, objectsOf, stopWhenClean, TestDaemon } from '../e2e/harness';
import { figure } from '../reliability/figures';

type Backend = 'host' | 'cuda';
const SIZE = 2n * MiB;
const access = (flags: AccessDescriptor['flags']): AccessDescriptor[] => [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags }];
const checksum = (data: Buffer) => createHash('sha256').update(data).digest('hex');

/** A memfd as a client may make one: sealable or not, then reopened or sealed as `how` says. Returns the fds to close. */
function clientMemfd(how: 'plain' | 'unsealable' | 'O_RDONLY' | 'O_WRONLY' | 'F_SEAL_WRITE' | 'F_SEAL_FUTURE_WRITE' | 'F_SEAL_SEAL'): {
  fd: number;
  close(): void;
} {
  const base = addon._memfdCreate(`attack-${how}`, SIZE, how !== 'unsealable');
  let fd = base;
  if (how === 'O_RDONLY') fd = fs.openSync(`/proc/self/fd/${base}`, fs.constants.O_RDONLY);
  if (how === 'O_WRONLY') fd = fs.openSync(`/proc/self/fd/${base}`, fs.constants.O_WRONLY);
  if (how === 'F_SEAL_WRITE') addon.hostMemfdAddSeals(base, MEMFD_SEALS.WRITE);
  if (how === 'F_SEAL_FUTURE_WRITE') addon.hostMemfdAddSeals(base, MEMFD_SEALS.FUTURE_WRITE);
  if (how === 'F_SEAL_SEAL') addon.hostMemfdAddSeals(base, MEMFD_SEALS.SEAL);
  return {
    fd,
    close: () => {
      if (fd !== base) fs.closeSync(fd);
      addon.close(base);
    },
  };
}

/** Shrinks a memfd to nothing, as the attacker does; returns the kernel's refusal code, or undefined when it shrank. */
function shrink(fd: number): string | undefined {
  try {
    fs.ftruncateSync(fd, 0);
    return undefined;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code;
  }
}

export function clientMemoryContract(backend: Backend, options: { full: boolean }): void {
  let daemon: TestDaemon | undefined;
  const clients: VmmdClient[] = [];
  const figures: Record<string, Record<string, string | number | boolean>> = {};

  async function client(): Promise<VmmdClient> {
    const connected = await connect({ socketDir: daemon!.dir });
    clients.push(connected);
    return connected;
  }

  const withToken = (session: VmmdClient) => {
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, session.session.token);
    return metadata;
  };

  /** A bystander session's memory, written with a pattern: it must read back the same after every attack. */
  async function bystander() {
    const v = await client();
    const allocation = await v.vmm.create({ size: SIZE });
    const { address } = await v.vmm.reserve({ size: SIZE });
    await v.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    await v.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
    const pattern = randomBytes(Number(SIZE));
    await v.vmm.write(address, pattern);
    return { intact: async () => checksum(await v.vmm.read(address, Number(SIZE))) === checksum(pattern) };
  }

  afterEach(async () => {
    await stopWhenClean(daemon, clients);
    daemon = undefined;
  });

  afterAll(() => {
    for (const [name, values] of Object.entries(figures)) figure(`client-memory-${name}-${backend}`, { backend, ...values });
  });

  it('never maps a memfd its sender can shrink: OpenStaging, Attach SYSMEM and Import, then ftruncate(0), then a copy', async () => {
    daemon = await TestDaemon.start(backend === 'cuda' ? ['--stock', 'none'] : [], backend);
    const witness = await bystander();
    const attacker = await client();
    const allocation = await attacker.vmm.create({ size: SIZE });
    const { address } = await attacker.vmm.reserve({ size: SIZE });
    await attacker.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    await attacker.vmm.setAccess({ address, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
    const baseline = objectsOf(await daemon.stats());
    const fdsBefore = daemon.openFds();
    const rounds = options.full ? 20 : 2;
    let tried = 0;
    let shrinksRefused = 0;
    let refusedUnsealable = 0;
    const ways = ['staging', 'attach', ...(backend === 'host' ? ['import'] : [])];
    for (let round = 0; round < rounds; round++) {
      for (const way of ways) {
        // A sealable memfd: the daemon seals it F_SEAL_SHRINK as it takes it, so the shrink fails and the copy works.
        const memfd = clientMemfd('plain');
        tried++;
        if (way === 'staging') {
          const metadata = withToken(attacker);
          await call(daemon.raw.vmm, 'OpenStaging', { transferId: attacker.session.sendDescriptor(memfd.fd) }, metadata);
          expect(shrink(memfd.fd)).toBe('EPERM');
          await call(daemon.raw.vmm, 'WriteStaged', { address: String(address), stagingOffset: '0', length: String(SIZE) }, metadata);
        } else if (way === 'attach') {
          const store = await attacker.stores.attachDescriptor(memfd.fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false });
          expect(shrink(memfd.fd)).toBe('EPERM');
          await attacker.stores.fill({ storeId: store.id }, SIZE, 0xab);
          await attacker.stores.detach(BigInt(store.id));
        } else {
          const imported = await attacker.vmm.importTransfer({ transferId: attacker.session.sendDescriptor(memfd.fd), size: SIZE });
          const { address: at } = await attacker.vmm.reserve({ size: SIZE });
          await attacker.vmm.map({ address: at, size: SIZE, allocationId: imported.id });
          await attacker.vmm.setAccess({ address: at, size: SIZE, descriptors: access('ACCESS_FLAGS_READWRITE') });
          expect(shrink(memfd.fd)).toBe('EPERM');
          expect((await attacker.vmm.read(at, 4096)).length).toBe(4096);
          await attacker.vmm.unmap({ address: at, size: SIZE });
          await attacker.vmm.freeAddress({ address: at, size: SIZE });
          await attacker.vmm.release({ allocationId: imported.id });
        }
        shrinksRefused++;
        memfd.close();
        // A memfd that cannot take the seal (no MFD_ALLOW_SEALING): refused when handed over, naming the seal.
        const unsealable = clientMemfd('unsealable');
        tried++;
        const refusal = await (
          way === 'staging'
            ? call(daemon.raw.vmm, 'OpenStaging', { transferId: attacker.session.sendDescriptor(unsealable.fd) }, withToken(attacker))
            : way === 'attach'
              ? attacker.stores.attachDescriptor(unsealable.fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false })
              : attacker.vmm.importTransfer({ transferId: attacker.session.sendDescriptor(unsealable.fd), size: SIZE })
        ).then(
          () => new Error(`${way} of an unsealable memfd succeeded`),
          (error: { code?: unknown; status?: number; message: string; metadata?: grpc.Metadata }) => error,
        );
        const status = (refusal as { status?: number }).status ?? (refusal as { code?: unknown }).code;
        expect(status).toBe(grpc.status.INVALID_ARGUMENT);
        expect(refusal.message).toMatch(/must be sealed F_SEAL_SHRINK/);
        // The daemon still maps nothing of it: the shrink succeeds, and the daemon is unhurt.
        expect(shrink(unsealable.fd)).toBeUndefined();
        refusedUnsealable++;
        unsealable.close();
      }
    }
    // Alive and serving, nothing left behind, the bystander's bytes as they were.
    await eventually(async () => (objectsOf(await daemon!.stats()).allocations === baseline.allocations ? true : undefined));
    expect(objectsOf(await daemon.stats())).toEqual(baseline);
    expect(await witness.intact()).toBe(true);
    // The staging buffer is the attacker session's until it ends; the rest went with their objects.
    expect(daemon.openFds()).toBeLessThanOrEqual(fdsBefore + 1);
    expect(daemon.process.exitCode).toBeNull();
    figures.shrink = { tried, shrinksRefusedByTheSeal: shrinksRefused, unsealableRefused: refusedUnsealable, crashes: 0, leaked: 0 };
  });

  it('refuses, when handed over, a descriptor whose mode or seals forbid the use (Import, Attach)', async () => {
    daemon = await TestDaemon.start(backend === 'cuda' ? ['--stock', 'none'] : [], backend);
    const witness = await bystander();
    const attacker = await client();
    const baseline = objectsOf(await daemon.stats());
    const fdsBefore = daemon.openFds();
    type Case = { way: 'import' | 'attach'; how: Parameters<typeof clientMemfd>[0]; readOnly?: boolean; says: RegExp };
    const cases: Case[] = [
      ...(backend === 'host'
        ? ([
            { way: 'import', how: 'O_RDONLY', says: /open read-only \(O_RDONLY\)/ },
            { way: 'import', how: 'O_WRONLY', says: /open write-only \(O_WRONLY\)/ },
            { way: 'import', how: 'F_SEAL_WRITE', says: /sealed F_SEAL_WRITE/ },
            { way: 'import', how: 'F_SEAL_FUTURE_WRITE', says: /sealed F_SEAL_FUTURE_WRITE/ },
          ] as Case[])
        : []),
      { way: 'attach', how: 'O_RDONLY', says: /open read-only \(O_RDONLY\)/ },
      { way: 'attach', how: 'O_WRONLY', says: /open write-only \(O_WRONLY\)/ },
      { way: 'attach', how: 'O_WRONLY', readOnly: true, says: /open write-only \(O_WRONLY\)/ },
      { way: 'attach', how: 'F_SEAL_WRITE', says: /sealed F_SEAL_WRITE/ },
      { way: 'attach', how: 'F_SEAL_FUTURE_WRITE', says: /sealed F_SEAL_FUTURE_WRITE/ },
      { way: 'attach', how: 'F_SEAL_SEAL', readOnly: true, says: /takes no more seals/ },
      { way: 'attach', how: 'unsealable', readOnly: true, says: /takes no more seals/ },
      { way: 'attach', how: 'O_RDONLY', readOnly: true, says: /only through a descriptor open O_RDWR/ },
    ];
    const rounds = options.full ? 10 : 1;
    let tried = 0;
    let refused = 0;
    for (let round = 0; round < rounds; round++) {
      for (const c of cases) {
        const memfd = clientMemfd(c.how);
        tried++;
        const attempt =
          c.way === 'import'
            ? attacker.vmm.importTransfer({ transferId: attacker.session.sendDescriptor(memfd.fd), size: SIZE })
            : attacker.stores.attachDescriptor(memfd.fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: c.readOnly ?? false });
        await expect(attempt).rejects.toMatchObject({ status: grpc.status.INVALID_ARGUMENT, code: 'BAD_DESCRIPTOR', message: expect.stringMatching(c.says) });
        refused++;
        memfd.close();
      }
    }
    // What such a descriptor may do, it does: a read-only descriptor of a memfd already sealed against shrinking and writes.
    const sealed = clientMemfd('plain');
    addon.hostMemfdAddSeals(sealed.fd, MEMFD_SEALS.SHRINK | MEMFD_SEALS.FUTURE_WRITE);
    const readable = fs.openSync(`/proc/self/fd/${sealed.fd}`, fs.constants.O_RDONLY);
    const imported =
      backend === 'host'
        ? await attacker.vmm.importTransfer({ transferId: attacker.session.sendDescriptor(readable), size: SIZE }).catch((error) => error)
        : undefined;
    if (imported !== undefined) expect(imported).toMatchObject({ code: 'BAD_DESCRIPTOR' });
    fs.closeSync(readable);
    sealed.close();
    expect(objectsOf(await daemon.stats())).toEqual(baseline);
    expect(await witness.intact()).toBe(true);
    await eventually(() => (daemon!.openFds() <= fdsBefore ? true : undefined), 20_000, 'the refused descriptors to be closed');
    figures['bad-descriptors'] = { tried, refused, cases: cases.length, internal: 0, leaked: 0 };
  });
}
