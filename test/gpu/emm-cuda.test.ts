/** The NBEP 7 manager, Config/Context and arrays on the cuda backend. */
import { emmContract } from '../contracts/emm.contract';
import { describeGpu } from './gpu';

describeGpu('cuda backend', () => {
  emmContract('cuda');
});
