/**
 * docs/PROTOCOL.md's table of refusals per RPC, checked against the code so
 * that it cannot drift:
 * - it has a row for every RPC of proto/vmmd/v1 and no other;
 * - every status and code it names is declared with that status in
 *   common/error-codes.ts (the compiler holds every code the daemon throws to
 *   its declaration);
 * - every code the daemon or a backend can answer with is in the table (or
 *   said not to reach an RPC), and every declared code is in the generated
 *   table of codes;
 * - refusals provoked for real on a daemon, over gRPC as grpcurl or another
 *   language would send them, each come back with a status and code the
 *   table lists for that RPC.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { ERROR_CODES } from '../../common/error-codes';
import { call, MiB, packageRoot, TestDaemon } from './harness';

const ROOT = packageRoot();
/** Codes the daemon declares that never answer an RPC, with where they go instead. */
const NOT_AN_RPC_ANSWER: Record<string, string> = {
  CUDA_UNAVAILABLE: 'the daemon stops at start (--backend cuda without a usable driver)',
  BUDGET_EXCEEDED: 'declared for server/registry/budgets.ts, which no service charges yet',
};

/** status → the codes common/error-codes.ts declares with it that can answer an RPC (the daemon's own and the backends'). */
function declaredForRpcs(): Map<string, Set<string>> {
  const declared = new Map<string, Set<string>>();
  for (const [code, { status, by }] of Object.entries(ERROR_CODES)) {
    if (by === 'daemon' || by === 'backend') declared.set(status, new Set([...(declared.get(status) ?? []), code]));
  }
  return declared;
}

/** PROTOCOL.md's generated table of every code: code → status. */
function documentedCodes(): Map<string, string> {
  const doc = fs.readFileSync(path.join(ROOT, 'docs', 'PROTOCOL.md'), 'utf8');
  const table = /<!-- error-codes:begin[^>]*-->([\s\S]*?)<!-- error-codes:end -->/.exec(doc);
  if (!table) throw new Error('docs/PROTOCOL.md has no error-codes table');
  return new Map([...table[1].matchAll(/^\| `([A-Z_0-9]+)` \| ([A-Z_]+) \|/gm)].map(([, code, status]) => [code, status]));
}

type Refusals = Map<string, Set<string>>; // status → codes

/** The table: RPC ("Service.Method", or "any RPC") → the refusals it lists, references resolved. */
function documented(): Map<string, Refusals> {
  const doc = fs.readFileSync(path.join(ROOT, 'docs', 'PROTOCOL.md'), 'utf8');
  const table = /<!-- codes-per-rpc:begin[^>]*-->([\s\S]*?)<!-- codes-per-rpc:end -->/.exec(doc);
  if (!table) throw new Error('docs/PROTOCOL.md has no codes-per-rpc table');
  const raw = new Map<string, string[]>();
  for (const [, rpc, cell] of table[1].matchAll(/^\| `?([A-Za-z .]+?)`? \| (.*) \|$/gm)) {
    if (rpc === 'RPC') continue;
    raw.set(rpc, cell === '—' ? [] : cell.split(' · '));
  }
  const resolved = new Map<string, Refusals>();
  const resolve = (rpc: string, seen: string[]): Refusals => {
    if (resolved.has(rpc)) return resolved.get(rpc)!;
    if (seen.includes(rpc)) throw new Error(`the table refers in a circle: ${[...seen, rpc].join(' → ')}`);
    const parts = raw.get(rpc);
    if (parts === undefined) throw new Error(`the table refers to ${rpc}, which has no row`);
    const refusals: Refusals = new Map();
    const merge = (other: Refusals) => {
      for (const [status, codes] of other) refusals.set(status, new Set([...(refusals.get(status) ?? []), ...codes]));
    };
    for (const part of parts) {
      const listed = /^([A-Z_]+): ([A-Z_, ]+)$/.exec(part);
      if (listed) {
        merge(new Map([[listed[1], new Set(listed[2].split(', '))]]));
        continue;
      }
      const references = [...part.matchAll(/([A-Za-z]+(?:\.[A-Za-z]+)?)'s/g)].map(([, name]) => (name.includes('.') ? name : `${rpc.split('.')[0]}.${name}`));
      if (references.length === 0) throw new Error(`${rpc}: cannot read "${part}"`);
      for (const reference of references) merge(resolve(reference, [...seen, rpc]));
    }
    resolved.set(rpc, refusals);
    return refusals;
  };
  for (const rpc of raw.keys()) resolve(rpc, []);
  return resolved;
}

function protoRpcs(): string[] {
  const rpcs: string[] = [];
  const dir = path.join(ROOT, 'proto', 'vmmd', 'v1');
  for (const file of fs.readdirSync(dir)) {
    const text = fs.readFileSync(path.join(dir, file), 'utf8');
    for (const [, service, body] of text.matchAll(/^service (\w+) \{([\s\S]*?)^\}/gm)) {
      for (const [, method] of body.matchAll(/^\s*rpc (\w+)\(/gm)) rpcs.push(`${service}.${method}`);
    }
  }
  return rpcs.sort();
}

describe('docs/PROTOCOL.md: refusals per RPC', () => {
  const table = documented();
  const raised = declaredForRpcs();

  test('a row for every RPC of the protos, and none for an RPC that does not exist', () => {
    expect([...table.keys()].filter((rpc) => !rpc.startsWith('any RPC')).sort()).toEqual(protoRpcs());
  });

  test('every code declared in common/error-codes.ts is in the generated table of codes, with its status', () => {
    const documented = documentedCodes();
    expect(
      Object.entries(ERROR_CODES)
        .filter(([code, { status }]) => documented.get(code) !== status)
        .map(([code]) => code),
    ).toEqual([]);
    expect([...documented.keys()].filter((code) => !(code in ERROR_CODES))).toEqual([]);
  });

  test('every status and code the table lists is declared with that status', () => {
    const unknown: string[] = [];
    for (const [rpc, refusals] of table) {
      for (const [status, codes] of refusals) {
        for (const code of codes) if (!raised.get(status)?.has(code)) unknown.push(`${rpc}: ${status} ${code}`);
      }
    }
    expect(unknown).toEqual([]);
  });

  test('every code the daemon or a backend can answer an RPC with is in the table (or said not to answer an RPC)', () => {
    const listed = new Set([...table.values()].flatMap((refusals) => [...refusals.values()].flatMap((codes) => [...codes])));
    const missing: string[] = [];
    for (const [status, codes] of raised) {
      for (const code of codes) {
        if (!listed.has(code) && NOT_AN_RPC_ANSWER[code] === undefined) missing.push(`${status} ${code}`);
      }
    }
    expect(missing).toEqual([]);
  });

  describe('refusals provoked on a daemon, as any gRPC client sends them', () => {
    let daemon: TestDaemon;
    const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];
    const seen: Array<{ rpc: string; status: string; code: string }> = [];

    beforeAll(async () => {
      daemon = await TestDaemon.start();
    });

    afterAll(async () => {
      expect(await daemon.stop()).toBe(0);
    });

    /** Calls a unary RPC expecting a refusal; records and returns its status and code. */
    async function refused(service: 'devices' | 'vmm' | 'stores' | 'admin', method: string, request: object): Promise<{ status: string; code: string }> {
      const rpc = `${{ devices: 'Devices', vmm: 'VirtualMemory', stores: 'Stores', admin: 'Admin' }[service]}.${method}`;
      try {
        await call(daemon.raw[service], method, request);
      } catch (error) {
        const failure = error as grpc.ServiceError;
        const result = { status: grpc.status[failure.code], code: String(failure.metadata.get('vmmd-error-code')[0]) };
        seen.push({ rpc, ...result });
        return result;
      }
      throw new Error(`${rpc} ${JSON.stringify(request)} was not refused`);
    }

    /** A server-streaming RPC's refusal. */
    function refusedStream(service: 'vmm' | 'stores', method: string, request: object): Promise<{ status: string; code: string }> {
      const rpc = `${{ vmm: 'VirtualMemory', stores: 'Stores' }[service]}.${method}`;
      return new Promise((resolve, reject) => {
        const stream = daemon.raw[service][method](request);
        stream.on('data', () => undefined);
        stream.on('end', () => reject(new Error(`${rpc} was not refused`)));
        stream.on('error', (failure: grpc.ServiceError) => {
          const result = { status: grpc.status[failure.code], code: String(failure.metadata.get('vmmd-error-code')[0]) };
          seen.push({ rpc, ...result });
          resolve(result);
        });
      });
    }

    test('each comes back as the table says for its RPC', async () => {
      const granule = 2n * MiB;
      const allocation = await call(daemon.raw.vmm, 'Create', { size: String(2n * granule) });
      const reservation = await call(daemon.raw.vmm, 'Reserve', { size: String(4n * granule) });
      await call(daemon.raw.vmm, 'Map', { address: reservation.address, size: String(2n * granule), allocationId: allocation.id });
      await call(daemon.raw.vmm, 'SetAccess', { address: reservation.address, size: String(2n * granule), descriptors: RW });
      const unmapped = String(BigInt(reservation.address) + 3n * granule);
      const released = await call(daemon.raw.vmm, 'Create', { size: String(granule) });
      await call(daemon.raw.vmm, 'Release', { allocationId: released.id });

      expect(await refused('devices', 'GetMemoryInfo', { device: 99 })).toMatchObject({ code: 'UNKNOWN_DEVICE' });
      expect(await refused('devices', 'GetGranularity', { location: { type: 'LOCATION_TYPE_DEVICE', id: 7 } })).toMatchObject({ code: 'UNKNOWN_DEVICE' });
      expect(await refused('vmm', 'Reserve', { size: '0' })).toMatchObject({ code: 'ZERO_SIZE' });
      expect(await refused('vmm', 'Reserve', { size: '4096' })).toMatchObject({ code: 'NOT_ALIGNED' });
      expect(await refused('vmm', 'FreeAddress', { address: reservation.address, size: String(4n * granule) })).toMatchObject({ code: 'RESERVATION_MAPPED' });
      expect(await refused('vmm', 'Create', { size: '0' })).toMatchObject({ code: 'ZERO_SIZE' });
      expect(await refused('vmm', 'Create', { size: String(granule), handleType: 'HANDLE_TYPE_FABRIC' })).toMatchObject({ status: 'FAILED_PRECONDITION' });
      expect(await refused('vmm', 'Release', { allocationId: released.id })).toMatchObject({ status: 'NOT_FOUND' });
      expect(await refused('vmm', 'Map', { address: unmapped, size: String(granule), allocationId: '999999' })).toMatchObject({ code: 'UNKNOWN_ALLOCATION' });
      expect(await refused('vmm', 'Map', { address: reservation.address, size: String(granule), allocationId: allocation.id })).toMatchObject({
        status: 'FAILED_PRECONDITION',
      });
      expect(await refused('vmm', 'Unmap', { address: reservation.address, size: String(granule) })).toMatchObject({ code: 'PARTIAL_UNMAP' });
      // SetAccess over half a mapping: it covers whole mappings only.
      await refused('vmm', 'SetAccess', { address: reservation.address, size: String(granule), descriptors: RW });
      await refused('vmm', 'SetAccess', { address: reservation.address, size: String(2n * granule), descriptors: [] });
      await refused('vmm', 'GetAccess', { address: unmapped, location: { type: 'LOCATION_TYPE_DEVICE', id: 0 } });
      // No session: descriptors cannot reach the caller.
      expect(await refused('vmm', 'Export', { allocationId: allocation.id })).toMatchObject({ code: 'NO_SESSION' });
      expect(await refused('vmm', 'Allocate', { size: String(granule) })).toMatchObject({ code: 'NO_SESSION' });
      expect(await refused('vmm', 'Import', { transferId: '1' })).toMatchObject({ code: 'NO_SESSION' });
      expect(await refused('vmm', 'OpenStaging', { transferId: '1' })).toMatchObject({ code: 'NO_SESSION' });
      await refused('vmm', 'ReadStaged', { address: reservation.address, length: '16', stagingOffset: '0' });
      await refused('vmm', 'WriteStaged', { address: reservation.address, length: '16', stagingOffset: '0' });
      expect(await refused('vmm', 'Share', { allocationId: '999999' })).toMatchObject({ code: 'UNKNOWN_ALLOCATION' });
      await refused('vmm', 'GetProperties', { allocationId: '999999' });
      await refused('vmm', 'RetainHandle', { address: unmapped });
      // Read of an address in a reservation but not mapped.
      await refusedStream('vmm', 'Read', { address: unmapped, length: '16' });
      await refusedStream('vmm', 'Read', { address: reservation.address, length: '0' });
      expect(await refused('stores', 'CreateStore', { allocationId: '999999' })).toMatchObject({ code: 'UNKNOWN_ALLOCATION' });
      expect(await refused('stores', 'Attach', { transferId: '1' })).toMatchObject({ code: 'NO_SESSION' });
      await refused('stores', 'Open', { store: { name: 'nothing-by-this-name' } });
      await refused('stores', 'Close', { storeId: '999999' });
      await refused('stores', 'Detach', { store: { name: 'nothing-by-this-name' } });
      await refusedStream('stores', 'Read', { length: '16' });
      await refusedStream('stores', 'Read', { span: { storeId: '999999' }, length: '16' });
      await refused('stores', 'Fill', { span: { address: unmapped }, length: '16', value: 0 });
      await refused('stores', 'Fill', { span: { address: reservation.address }, length: '16', value: 300 });
      await refused('stores', 'Copy', { source: { address: unmapped }, target: { address: reservation.address }, length: '16' });

      const notListed = seen.filter(({ rpc, status, code }) => !table.get(rpc)?.get(status)?.has(code));
      expect(notListed).toEqual([]);
      // Most RPCs that can refuse were made to.
      expect(new Set(seen.map(({ rpc }) => rpc)).size).toBeGreaterThanOrEqual(28);
    });
  });
});
