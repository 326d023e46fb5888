/** Allocations ahead of the NBEP 7 manager on the cuda backend. */
import { aheadContract } from '../contracts/ahead.contract';
import { describeGpu } from './gpu';

describeGpu('cuda backend', () => {
  aheadContract('cuda');
});
