/** Every rule of the registry, on the real driver. */
import pino from 'pino';
import { CudaBackend } from '../../server/backends/cuda';
import { registryContract } from '../contracts/registry.contract';
import { releaseEarlyContract } from '../contracts/release-early.contract';
import { describeGpu } from './gpu';

describeGpu('registry on the cuda backend', () => {
  registryContract(() => CudaBackend.open(pino({ level: 'silent' })));
});

describeGpu('a release that answers before the free, on the cuda backend', () => {
  releaseEarlyContract(() => CudaBackend.open(pino({ level: 'silent' })));
});
