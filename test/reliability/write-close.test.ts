/**
 * Write-then-close on the host backend (test/reliability/write-close-scenario.ts),
 * the host analogue of the cuda failure it guards against (an unmap under a copy
 * in flight faults the context): a copy in flight when close()
 * is called completes before the unmap, and the bytes land.
 */
import { writeCloseScenario } from './write-close-scenario';

const FULL = process.env.VMMD_RELIABILITY === 'full';

it('write awaited then close, 4 processes: no error', () => writeCloseScenario('host', 4, FULL ? 100 : 20, 'awaited'), 120_000);
it('close while the write is in flight, 4 processes: close waits, no error', () => writeCloseScenario('host', 4, FULL ? 100 : 20, 'unawaited'), 120_000);
it('bytes written are read back through another mapping, 2 processes', () => writeCloseScenario('host', 2, FULL ? 50 : 10, 'verified'), 120_000);
