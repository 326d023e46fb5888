/** The registry's rules on the real host backend: real memfds, real mappings. */
import { HostBackend } from '../../server/backends/host';
import { registryContract } from '../contracts/registry.contract';
import { releaseEarlyContract } from '../contracts/release-early.contract';

const MiB = 1n << 20n;

describe('registry on the host backend', () => {
  registryContract(() => new HostBackend({ capacity: 64n * MiB, granularity: 2n * MiB }), { capacity: 64n * MiB });
});

describe('a release that answers before the free, on the host backend', () => {
  releaseEarlyContract(() => new HostBackend({ capacity: 64n * MiB, granularity: 2n * MiB }));
});
