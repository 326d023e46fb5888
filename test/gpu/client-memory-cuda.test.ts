/**
 * Client memory the daemon maps, on the cuda backend
 * (test/contracts/client-memory.contract.ts): staging buffers and SYSMEM
 * attachments are memfds there too. (Import of a memfd is the host backend's;
 * a CUDA descriptor cannot shrink: the driver keeps imported memory alive
 * whatever its exporter does.)
 */
import { clientMemoryContract } from '../contracts/client-memory.contract';
import { describeGpu } from './gpu';

describeGpu('client memory (cuda)', () => {
  clientMemoryContract('cuda', { full: false });
});
