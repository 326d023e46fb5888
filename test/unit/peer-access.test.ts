/**
 * A client's CUDA mapping opens to every device that can reach its device as a
 * peer (cuDeviceCanAccessPeer), as cuMemAlloc memory does once peer access is
 * on: code written for it copies between two devices' buffers. Against a
 * stand-in addon with three devices, where 0 and 1 reach each other and 2
 * reaches nobody.
 */
const grants: Array<{ call: string; device: number; peers: number[] }> = [];
const REACHES = new Set(['1->0', '0->1']);

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
    cudaSetAccess: async (_address: bigint, _size: bigint, descriptors: Array<{ type: number; id: number }>) => {
      grants.push({ call: 'map', device: descriptors[0].id, peers: descriptors.slice(1).map((d) => d.id) });
    },
    cudaImportMap: async (_fd: number, _address: bigint, _size: bigint, device: number, _flags: number, _hostNuma: number, peers?: number[]) => {
      grants.push({ call: 'import', device, peers: peers ?? [] });
      return undefined;
    },
  };
  return { ...actual, addon: fake };
});

import { DeviceMapping } from '../../native/mapping';

const MiB = 1024n * 1024n;

describe('a CUDA mapping', () => {
  beforeEach(() => (grants.length = 0));

  it('made with one import call opens to the devices that reach its device', async () => {
    await DeviceMapping.importDescriptor(0, 99, 2n * MiB, 2n * MiB, { readOnly: false });
    await DeviceMapping.importDescriptor(2, 99, 2n * MiB, 2n * MiB, { readOnly: false });
    expect(grants).toEqual([
      { call: 'import', device: 0, peers: [1] },
      { call: 'import', device: 2, peers: [] },
    ]);
  });

  it('made step by step opens to them too', async () => {
    await DeviceMapping.map(1, 7n, 2n * MiB, 2n * MiB, { readOnly: true });
    expect(grants).toEqual([{ call: 'map', device: 1, peers: [0] }]);
  });
});
