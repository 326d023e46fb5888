/** Allocations ahead of the NBEP 7 manager on the host backend. */
import { aheadContract } from '../contracts/ahead.contract';

describe('host backend', () => {
  aheadContract('host');
});
