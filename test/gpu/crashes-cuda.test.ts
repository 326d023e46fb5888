/**
 * Client crashes on the cuda backend (test/reliability/crash-scenario.ts):
 * 100 clients killed at random points; device memory, objects and descriptors
 * return to the baseline, and the witness's device memory keeps its checksum.
 */
import { crashScenario } from '../reliability/crash-scenario';
import { describeGpu } from './gpu';

describeGpu('client crashes on the cuda backend', () => {
  it('reclaims everything of 100 clients killed at random points, and a witness keeps its memory', () => crashScenario('cuda', 100), 600_000);
});
