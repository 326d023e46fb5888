/** Stores on the host backend. */
import { storesContract } from '../contracts/stores.contract';

describe('host backend', () => {
  storesContract('host');
});
