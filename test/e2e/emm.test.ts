/** The NBEP 7 manager, Config/Context and arrays on the host backend. */
import { emmContract } from '../contracts/emm.contract';

describe('host backend', () => {
  emmContract('host');
});
