/** Stores on the cuda backend: device-located and host-located. */
import { storesContract } from '../contracts/stores.contract';
import { describeGpu } from './gpu';

describeGpu('cuda backend', () => {
  storesContract('cuda');
});
