/**
 * The daemon's staging buffers page-locked where the backend copies by DMA
 * (so a staged copy is a DMA), against a recorded pinning: pinned when opened (up to the
 * limit), unpinned only once no copy uses the buffer and before it is
 * unmapped, a refused pin leaves a working buffer, and without pinning
 * (the host backend) nothing changes.
 */
import { addon } from '../../native';
import { MAX_PINNED_STAGING_BYTES, StagingBuffers, StagingPinning } from '../../server/stores/staging';

const MiB = 1n << 20n;
const SESSION = 7n;

/** A pinning that records its calls, and fails once when told. */
function recorded(): StagingPinning & { calls: string[]; failNext: boolean } {
  const made = {
    calls: [] as string[],
    failNext: false,
    async pin(_address: bigint, size: bigint) {
      made.calls.push(`pin ${size / MiB} MiB`);
      if (made.failNext) {
        made.failNext = false;
        throw Object.assign(new Error('CUDA_ERROR_OUT_OF_MEMORY: cuMemHostRegister(33554432)'), { code: 'CUDA_ERROR_OUT_OF_MEMORY' });
      }
    },
    async unpin() {
      made.calls.push('unpin');
    },
  };
  return made;
}

describe('page-locked staging buffers', () => {
  it('pins a buffer when it opens and unpins it only after the copy in flight, before the unmap', async () => {
    const pinning = recorded();
    const staging = new StagingBuffers(pinning);
    await staging.open(SESSION, addon.hostMemfdCreate('staging', 32n * MiB));
    expect(pinning.calls).toEqual(['pin 32 MiB']);
    expect(staging.isPinned(SESSION)).toBe(true);
    let finish!: () => void;
    const copy = staging.use(SESSION, 0n, 4096n, (view) => {
      pinning.calls.push('copy started');
      view.fill(1);
      return new Promise<void>((resolve) => (finish = resolve));
    });
    const closed = staging.close(SESSION);
    await new Promise((resolve) => setImmediate(resolve));
    expect(pinning.calls).toEqual(['pin 32 MiB', 'copy started']);
    pinning.calls.push('copy landed');
    finish();
    await copy;
    await closed;
    expect(pinning.calls).toEqual(['pin 32 MiB', 'copy started', 'copy landed', 'unpin']);
    expect(staging.isPinned(SESSION)).toBe(false);
  });

  it('leaves a buffer above the limit unpinned, and it works', async () => {
    const pinning = recorded();
    const staging = new StagingBuffers(pinning);
    const size = MAX_PINNED_STAGING_BYTES + 2n * MiB;
    await staging.open(SESSION, addon.hostMemfdCreate('staging', size));
    expect(pinning.calls).toEqual([]);
    expect(staging.isPinned(SESSION)).toBe(false);
    await staging.use(SESSION, size - 4096n, 4096n, async (view) => view.fill(2));
    await staging.close(SESSION);
    expect(pinning.calls).toEqual([]);
  });

  it('uses a buffer whose pin the driver refused as it is, says so, and never unpins it', async () => {
    const pinning = recorded();
    pinning.failNext = true;
    const warnings: string[] = [];
    const staging = new StagingBuffers(pinning, (message) => warnings.push(message));
    await staging.open(SESSION, addon.hostMemfdCreate('staging', 32n * MiB));
    expect(warnings).toEqual([
      expect.stringMatching(/^a staging buffer of 33554432 bytes could not be page-locked \(CUDA_ERROR_OUT_OF_MEMORY: cuMemHostRegister/),
    ]);
    expect(staging.isPinned(SESSION)).toBe(false);
    expect(await staging.use(SESSION, 0n, 16n, async (view) => view.length)).toBe(16);
    await staging.close(SESSION);
    expect(pinning.calls).toEqual(['pin 32 MiB']);
  });

  it('unpins the buffer a second OpenStaging replaces', async () => {
    const pinning = recorded();
    const staging = new StagingBuffers(pinning);
    await staging.open(SESSION, addon.hostMemfdCreate('staging', 32n * MiB));
    await staging.open(SESSION, addon.hostMemfdCreate('staging', 16n * MiB));
    expect(pinning.calls).toEqual(['pin 32 MiB', 'pin 16 MiB', 'unpin']);
    await staging.close(SESSION);
    expect(pinning.calls).toEqual(['pin 32 MiB', 'pin 16 MiB', 'unpin', 'unpin']);
  });

  it('pins nothing without a pinning (the host backend)', async () => {
    const staging = new StagingBuffers();
    await staging.open(SESSION, addon.hostMemfdCreate('staging', 32n * MiB));
    expect(staging.isPinned(SESSION)).toBe(false);
    await staging.close(SESSION);
  });
});
