/**
 * A daemon start that fails after its admin service was made stops what that
 * service started (its GC observer, its delay sampler). In process, from
 * dist/ (the daemon finds its package.json from there).
 */
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { packageRoot } from './harness';

// Required at run time (a static import of dist/ would make its declarations the compiler's inputs).
const fromDist = <T>(module: string): T => require(path.join(packageRoot(), 'dist', module)) as T;
const { addon } = fromDist<typeof import('../../native')>('native');
const { parseCommandLine } = fromDist<typeof import('../../server/config')>('server/config');
const { Daemon } = fromDist<typeof import('../../server/daemon')>('server/daemon');
const { GcPauses } = fromDist<typeof import('../../server/gc-pauses')>('server/gc-pauses');

describe('a start that fails late', () => {
  it('stops the GC observer it started (the metrics port taken)', async () => {
    const busy = net.createServer();
    await new Promise<void>((resolve) => busy.listen(0, '127.0.0.1', resolve));
    const port = (busy.address() as net.AddressInfo).port;
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-review-gc-'));
    const started = jest.spyOn(GcPauses.prototype, 'start');
    const stopped = jest.spyOn(GcPauses.prototype, 'stop');
    try {
      const command = parseCommandLine(['--backend', 'host', '--socket-dir', dir, '--metrics-port', String(port)], {}, addon.pageSize());
      if (command.kind !== 'run') throw new Error('not a run');
      await expect(Daemon.start(command.config, pino({ level: 'silent' }))).rejects.toThrow(/EADDRINUSE/);
      expect(started).toHaveBeenCalledTimes(1);
      expect(stopped).toHaveBeenCalledTimes(1);
    } finally {
      started.mockRestore();
      stopped.mockRestore();
      busy.close();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
