/**
 * Quotas and capacity by physical memory on the host backend, with figures
 * (test/contracts/quotas.contract.ts: charges dodged through one's own descriptors).
 * Larger with VMMD_RELIABILITY=full (npm run reliability).
 */
import { quotaContract } from '../contracts/quotas.contract';

describe('quotas by physical memory (host)', () => {
  quotaContract('host', { full: process.env.VMMD_RELIABILITY === 'full' });
});
