/**
 * A gRPC call whose deadline passes while it waits for its turn is not run:
 * its caller has been told DEADLINE_EXCEEDED already (grpc-js answers at the
 * deadline), so work done for it would be work nobody learns of: memory made
 * for an answer that never arrives. The real listener and handler wrapper,
 * two calls read in one turn: the first holds the event loop past the
 * second's deadline, as a burst of other work would.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { loadProtos } from '../../common/proto';
import { AccessPolicy } from '../../server/transport/grpc/access';
import { GrpcUnixListener } from '../../server/transport/grpc/grpc-unix';
import { FairCalls } from '../../server/transport/grpc/services/fair-calls';
import { HandlerDeps, unary } from '../../server/transport/grpc/services/handler';
import { SessionManager } from '../../server/transport/session/sessions';

const HOLD_MS = 300;
const DEADLINE_MS = 100;

function busyFor(ms: number): void {
  const until = Date.now() + ms;
  while (Date.now() < until) {
    // the event loop held, as a long turn of other work holds it
  }
}

describe('a gRPC call whose deadline passed while it waited', () => {
  it('is not run, and its caller gets DEADLINE_EXCEEDED', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-deadline-'));
    const socket = path.join(dir, 'grpc.sock');
    const log = pino({ level: 'silent' });
    const uid = process.getuid?.() ?? 0;
    const deps: HandlerDeps = {
      sessions: new SessionManager(log),
      access: new AccessPolicy({ allowUids: [uid], allowGids: [], adminUids: [uid], adminGids: [] }),
      streamStallMs: 1_000,
      log,
      fair: new FairCalls(),
    };
    let ran = 0;
    const server = new grpc.Server();
    server.addService(loadProtos().proto.vmmd.v1.Devices.service, {
      ListDevices: unary(deps, 'ListDevices', () => {
        busyFor(HOLD_MS);
        return { devices: [] };
      }),
      GetMemoryInfo: unary(deps, 'GetMemoryInfo', () => {
        ran++;
        return { freeBytes: '0', totalBytes: '0' };
      }),
    });
    const listener = await GrpcUnixListener.listen(server, socket, log);
    const client = new (loadProtos().proto.vmmd.v1.Devices)(`unix://${socket}`, grpc.credentials.createInsecure());
    try {
      // Connected first: both calls then go out together and are read in one turn.
      await new Promise<void>((resolve, reject) => client.waitForReady(Date.now() + 5_000, (error?: Error) => (error ? reject(error) : resolve())));
      const holding = new Promise<void>((resolve, reject) => client.ListDevices({}, (error: Error | null) => (error ? reject(error) : resolve())));
      const late = new Promise<grpc.ServiceError | null>((resolve) =>
        client.GetMemoryInfo({}, { deadline: Date.now() + DEADLINE_MS }, (error: grpc.ServiceError | null) => resolve(error)),
      );
      await holding;
      expect((await late)?.code).toBe(grpc.status.DEADLINE_EXCEEDED);
      // Its turn came after the deadline: nothing ran for it.
      await new Promise((resolve) => setTimeout(resolve, 50));
      expect(ran).toBe(0);
    } finally {
      client.close();
      listener.close();
      server.forceShutdown();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
