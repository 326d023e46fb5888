/**
 * Whether this machine can run the GPU suite. Without a usable driver every
 * GPU test is skipped, and the reason is printed once.
 */
import { addon } from '../../native';

export const cuda = addon.cudaLoad();

if (!cuda.loaded) {
  console.warn(`test/gpu skipped: ${cuda.reason}`);
}

/** `describe` on a GPU host, `describe.skip` elsewhere. */
export const describeGpu: jest.Describe = cuda.loaded ? describe : describe.skip;
