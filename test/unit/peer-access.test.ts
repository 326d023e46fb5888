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
const setAccessGate: { wait?: Promise<void> } = {};

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
    cudaUnmap: async () => undefined,
    cudaSetAccess: async (address: bigint, _size: bigint, descriptors: Array<{ id: number; flags: number }>) => {
      const gate = setAccessGate.wait;
      grants.push({ call: 'setAccess', address, ids: descriptors.map((d) => d.id), flags: descriptors.map((d) => d.flags) });
      if (gate !== undefined) await gate;
    },
    cudaImportMap: async (_fd: number, address: bigint, _size: bigint, device: number, flags: number, _hostNuma: number, peers?: number[]) => {
      grants.push({ call: 'import', address, ids: [device, ...(peers ?? [])], flags: [flags] });
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
    setAccessGate.wait = undefined;
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
});
