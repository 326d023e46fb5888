/**
 * Quotas by physical memory on the cuda backend (test/contracts/quotas.contract.ts):
 * Create, Export, Import of one's own descriptor, Release (each cuda import is
 * counted on its own, so the import is refused beside the original), SYSMEM
 * attachments of sparse memfds charged by their size, one memfd attached twice counted once.
 */
import { quotaContract } from '../contracts/quotas.contract';
import { describeGpu } from './gpu';

describeGpu('quotas by physical memory (cuda)', () => {
  quotaContract('cuda', { full: false });
});
