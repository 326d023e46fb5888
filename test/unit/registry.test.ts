/** The registry's rules against the fake backend: fast, and strict about the driver's preconditions. */
import { registryContract } from '../contracts/registry.contract';
import { releaseEarlyContract } from '../contracts/release-early.contract';
import { FakeBackend, MiB } from './fake-backend';

describe('registry on the fake backend', () => {
  registryContract(() => new FakeBackend(), { capacity: 64n * MiB });
});

describe('a release that answers before the free, on the fake backend', () => {
  releaseEarlyContract(() => new FakeBackend({ capacity: 64n * MiB }));
});
