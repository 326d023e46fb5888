/**
 * Client memory the daemon maps (test/contracts/client-memory.contract.ts) on
 * the host backend: shrunk memfds and descriptors whose mode or seals forbid
 * the use. Larger with VMMD_RELIABILITY=full (npm run reliability).
 */
import { clientMemoryContract } from '../contracts/client-memory.contract';

describe('client memory (host)', () => {
  clientMemoryContract('host', { full: process.env.VMMD_RELIABILITY === 'full' });
});
