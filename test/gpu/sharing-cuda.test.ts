/** Cross-process sharing and SIGKILL reclaim on the cuda backend: device pointers in two processes. */
import { sharingContract } from '../contracts/sharing.contract';
import { describeGpu } from './gpu';

describeGpu('cuda backend', () => {
  sharingContract('cuda');
});
