/**
 * Injected faults on the cuda backend: each driver step of create, export,
 * map, access, store creation, attach, detach, unmap, free and release failing
 * in turn leaves no partial state (test/contracts/faults.contract.ts).
 */
import { faultsContract } from '../contracts/faults.contract';
import { describeGpu } from './gpu';

describeGpu('an operation whose driver step fails (cuda)', () => {
  faultsContract('cuda');
});
