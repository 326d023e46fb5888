/**
 * Security on the host backend, with figures (test/contracts/security.contract.ts),
 * and peers of another uid, which only root can start (CI runs as root).
 * Larger with VMMD_RELIABILITY=full (npm run reliability).
 */
import * as fs from 'node:fs';
import { socketPaths } from '../../common/paths';
import { securityContract } from '../contracts/security.contract';
import { Peer, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;

describe('security (host)', () => {
  securityContract('host', { full: FULL });

  (isRoot ? it : it.skip)('gives a peer of a uid not allowed no session, however often it tries (run as root)', async () => {
    const daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0']);
    try {
      expect(fs.statSync(daemon.dir).mode & 0o777).toBe(0o750);
      expect(fs.statSync(socketPaths(daemon.dir).session).mode & 0o777).toBe(0o660);
      const attempts = FULL ? 20 : 4;
      for (let i = 0; i < attempts; i++) {
        await expect(Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY })).rejects.toMatchObject({
          code: 'PERMISSION_DENIED',
          message: expect.stringMatching(/uid 65534 \(gid 65534\) is not allowed/),
        });
      }
      expect((await daemon.stats()).sessions).toBe(0);
      figure('security-uid-host', { attempts, refused: attempts, sessionsGranted: 0 });
    } finally {
      await daemon.stop();
    }
  });
});
