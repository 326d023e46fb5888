/**
 * A client's CUDA mapping opens to the devices that can reach its device as a
 * peer (cuDeviceCanAccessPeer) and that this process maps memory on too, and
 * a device's first mapping opens the mappings made before it to that device,
 * as cuMemAlloc memory opens to the peers that enabled peer access: code
 * written for it copies between two devices' buffers, and a process that maps
 * on one device pays for no peer. Against a stand-in addon with three
 * devices, where 0 and 1 reach each other and 2 reaches nobody.
 */
const grants: Array<{ call: string; address: bigint; ids: number[]; flags: number[] }> = [];
const REACHES = new Set(['1->0', '0->1']);
const setAccessGate: { wait?: Promise<void>; failNext?: boolean; afterImport?: () => Promise<void> } = {};
const unmaps: bigint[] = [];

jest.mock('../../native/index', () => {
  const actual = jest.requireActual('../../native/index');
  let next = 0x7f00_0000_0000n;
  const fake = {
    ...actual.addon,
    cudaLoad: () => ({ loaded: true }),
    cudaDevices: () => [{}, {}, {}],
    cudaCanAccessPeer: (device: number, owner: number) => REACHES.has(`${device}->${owner}`),
    cudaReserve: (size: bigint) => {
      const address = next;
      next += size;
      return address;
    },
    cudaFreeAddress: () => undefined,
    cudaMap: async () => undefined,
    cudaUnmap: async (_device: number, address: bigint) => void unmaps.push(address),
    cudaSetAccess: async (address: bigint, _size: bigint, descriptors: Array<{ id: number; flags: number }>) => {
      if (setAccessGate.failNext) {
        setAccessGate.failNext = false;
        setAccessGate.afterImport = undefined;
        throw Object.assign(new Error('CUDA_ERROR_INVALID_VALUE'), { code: 'CUDA_ERROR_INVALID_VALUE' });
      }
      const gate = setAccessGate.wait;
      grants.push({ call: 'setAccess', address, ids: descriptors.map((d) => d.id), flags: descriptors.map((d) => d.flags) });
      if (gate !== undefined) await gate;
    },
    cudaImportMap: async (_fd: number, address: bigint, _size: bigint, device: number, flags: number, _hostNuma: number, peers?: number[]) => {
      grants.push({ call: 'import', address, ids: [device, ...(peers ?? [])], flags: [flags] });
      const after = setAccessGate.afterImport;
      setAccessGate.afterImport = undefined;
      if (after !== undefined) await after();
      return undefined;
    },
  };
  return { ...actual, addon: fake };
});

import type { DeviceMapping as DeviceMappingType } from '../../native/mapping';

const MiB = 1024n * 1024n;
const RW = { readOnly: false };
let DeviceMapping: typeof DeviceMappingType;

describe('a CUDA mapping', () => {
  beforeEach(() => {
    grants.length = 0;
    unmaps.length = 0;
    setAccessGate.wait = undefined;
    setAccessGate.failNext = false;
    setAccessGate.afterImport = undefined;
    // A new process: no device used yet, no mapping open.
    jest.isolateModules(() => ({ DeviceMapping } = require('../../native/mapping')));
  });

  it('opens to no peer while the process maps on one device', async () => {
    await DeviceMapping.importDescriptor(0, 99, 2n * MiB, 2n * MiB, RW);
    await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    expect(grants.map((g) => [g.call, g.ids])).toEqual([
      ['import', [0]],
      ['setAccess', [0]],
    ]);
  });

  it("opens to a peer once the process maps there, and the peer's first mapping opens those before it, with their own access", async () => {
    const first = await DeviceMapping.importDescriptor(0, 99, 2n * MiB, 2n * MiB, { readOnly: true });
    const gone = await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    await gone.unmap();
    const lone = await DeviceMapping.map(2, 7n, 2n * MiB, 2n * MiB, RW); // device 2: reaches nobody, nobody reaches it
    grants.length = 0;
    const second = await DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW);
    expect(grants).toEqual([
      { call: 'setAccess', address: first.address, ids: [1], flags: [1] },
      { call: 'setAccess', address: second.address, ids: [1, 0], flags: [3, 3] },
    ]);
    grants.length = 0;
    await DeviceMapping.importDescriptor(0, 99, 2n * MiB, 2n * MiB, RW);
    await DeviceMapping.importDescriptor(2, 99, 2n * MiB, 2n * MiB, RW);
    expect(grants.map((g) => [g.call, g.ids])).toEqual([
      ['import', [0, 1]],
      ['import', [2]],
    ]);
    expect(lone.device).toBe(2);
  });

  it('made while a peer joins ends open to that peer too', async () => {
    await DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW);
    let release!: () => void;
    setAccessGate.wait = new Promise((resolve) => (release = resolve));
    // Its access is being set (device 1 is not used yet when it chose its peers) when device 0's first mapping starts.
    grants.length = 0;
    const racing = DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW);
    await new Promise((resolve) => setImmediate(resolve));
    setAccessGate.wait = undefined;
    const joined = DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    release();
    const [late] = await Promise.all([racing, joined]);
    const opened = grants.filter((g) => g.address === late.address).flatMap((g) => g.ids);
    expect(opened).toEqual(expect.arrayContaining([1, 0]));
  });

  it('a suspended mapping is not opened to a joining peer; resumed, it opens to the peers used by then', async () => {
    const sleeper = await DeviceMapping.importDescriptor(0, 99, 2n * MiB, 2n * MiB, RW);
    await sleeper.suspend();
    await DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW);
    expect(grants.filter((g) => g.address === sleeper.address && g.call === 'setAccess')).toEqual([]);
    await sleeper.resume(99, RW);
    expect(grants[grants.length - 1]).toEqual({ call: 'import', address: sleeper.address, ids: [0, 1], flags: [3] });
  });

  it("a mapping closed during a join is skipped, and its range, taken by a new mapping, keeps that mapping's access", async () => {
    const first = await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    const closing = await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, { readOnly: true });
    let release!: () => void;
    setAccessGate.wait = new Promise((resolve) => (release = resolve));
    grants.length = 0;
    const joined = DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW); // the join waits on the first mapping's grant
    await new Promise((resolve) => setImmediate(resolve));
    expect(grants).toEqual([{ call: 'setAccess', address: first.address, ids: [1], flags: [3] }]);
    setAccessGate.wait = undefined;
    await closing.unmap();
    const reused = await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    expect(reused.address).toBe(closing.address);
    release();
    await joined;
    expect(grants.filter((g) => g.address === reused.address)).toEqual([{ call: 'setAccess', address: reused.address, ids: [0, 1], flags: [3, 3] }]);
  });

  it('two first mappings of a device at once open an earlier mapping to it once', async () => {
    const first = await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    grants.length = 0;
    await Promise.all([DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW), DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW)]);
    expect(grants.filter((g) => g.address === first.address)).toEqual([{ call: 'setAccess', address: first.address, ids: [1], flags: [3] }]);
  });

  it('a join that fails fails its mapping, leaves nothing of it, and the next mapping of that device tries again', async () => {
    const first = await DeviceMapping.map(0, 7n, 2n * MiB, 2n * MiB, RW);
    setAccessGate.failNext = true;
    await expect(DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW)).rejects.toMatchObject({ code: 'CUDA_ERROR_INVALID_VALUE' });
    grants.length = 0;
    const second = await DeviceMapping.importDescriptor(1, 99, 2n * MiB, 2n * MiB, RW);
    expect(grants).toEqual([
      { call: 'setAccess', address: first.address, ids: [1], flags: [3] },
      { call: 'import', address: second.address, ids: [1, 0], flags: [3] },
    ]);
  });

  it('a resume whose grant to a peer fails is asleep again and can be resumed later', async () => {
    const sleeper = await DeviceMapping.importDescriptor(0, 99, 2n * MiB, 2n * MiB, RW);
    await sleeper.suspend();
    // Device 1 joins while the import of the resume runs: the grant the resume then owes it fails.
    setAccessGate.afterImport = async () => {
      await DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, RW);
      setAccessGate.failNext = true;
    };
    await expect(sleeper.resume(99, RW)).rejects.toMatchObject({ code: 'CUDA_ERROR_INVALID_VALUE' });
    expect(unmaps[unmaps.length - 1]).toBe(sleeper.address);
    grants.length = 0;
    await sleeper.resume(99, RW);
    expect(grants).toEqual([{ call: 'import', address: sleeper.address, ids: [0, 1], flags: [3] }]);
  });
});
