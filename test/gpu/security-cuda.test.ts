/**
 * Security on the cuda backend (test/contracts/security.contract.ts): isolation,
 * transfer ids, read-only stores (the daemon's refusals; CUDA has no seal, so
 * the descriptor checks are host-only) and quotas under concurrent requests.
 */
import { securityContract } from '../contracts/security.contract';
import { describeGpu } from './gpu';

describeGpu('security (cuda)', () => {
  securityContract('cuda', { full: false });
});
