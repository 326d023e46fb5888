/**
 * Write then close on the cuda backend (no unmap under a copy in flight): allocate → write 4 KiB → close →
 * release in a loop, no read between the write and the close, in 4 and in 32
 * processes at once. Before the fix a write resolved once the driver had
 * staged the bytes, close() unmapped under the copy engine's DMA, and the
 * context was poisoned (CUDA_ERROR_LAUNCH_FAILED at the next copy).
 */
import { writeCloseScenario } from '../reliability/write-close-scenario';
import { describeGpu } from './gpu';

describeGpu('write then close on the cuda backend', () => {
  it('4 processes, write awaited then close: no error', () => writeCloseScenario('cuda', 4, 30, 'awaited'), 120_000);
  it('32 processes, write awaited then close: no error', () => writeCloseScenario('cuda', 32, 30, 'awaited'), 180_000);
  it('32 processes, close while the write is in flight: close waits, no error', () => writeCloseScenario('cuda', 32, 30, 'unawaited'), 180_000);
  it('8 processes, the bytes written are the bytes read back through another mapping', () => writeCloseScenario('cuda', 8, 20, 'verified'), 120_000);
});
