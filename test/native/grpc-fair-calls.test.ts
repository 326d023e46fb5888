/**
 * gRPC calls are started in turns shared over uids: one uid's connection
 * with thousands of calls pipelined, and another uid calling one at a time.
 * The real listener (server/transport/grpc/grpc-unix.ts) and handler wrapper
 * (services/handler.ts) over a recording ListDevices: each victim call's
 * start says how many flood calls started between the victim's send and its
 * own start. The flood runs as another uid (needs root, as CI runs).
 */
import * as grpc from '@grpc/grpc-js';
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { loadProtos } from '../../common/proto';
import { AccessPolicy } from '../../server/transport/grpc/access';
import { GrpcUnixListener } from '../../server/transport/grpc/grpc-unix';
import { CALLS_PER_UID_TURN, FairCalls } from '../../server/transport/grpc/services/fair-calls';
import { HandlerDeps, unary } from '../../server/transport/grpc/services/handler';
import { SessionManager } from '../../server/transport/session/sessions';

const isRoot = process.getuid?.() === 0;
const FLOOD_UID = 4242;
const IN_FLIGHT = 2_000;
const VICTIM_CALLS = 10;
const DIST = path.join(__dirname, '..', '..', 'dist');

const describeAsRoot = isRoot ? describe : describe.skip;
if (!isRoot) console.warn('not root: the flood cannot run as another uid; the gRPC fair-calls test is skipped');

/** A process of uid FLOOD_UID keeping IN_FLIGHT ListDevices calls pipelined on one connection. */
function flood(socket: string) {
  const script = `
    const grpc = require(${JSON.stringify(require.resolve('@grpc/grpc-js'))});
    const { loadProtos } = require(${JSON.stringify(path.join(DIST, 'common', 'proto.js'))});
    const client = new (loadProtos().proto.vmmd.v1.Devices)('unix://${socket}', grpc.credentials.createInsecure());
    let answered = 0;
    const again = () => client.ListDevices({}, () => { if (++answered === ${IN_FLIGHT}) process.stdout.write('flooding\\n'); again(); });
    for (let i = 0; i < ${IN_FLIGHT}; i++) again();
  `;
  return spawn(process.execPath, ['-e', script], { uid: FLOOD_UID, gid: FLOOD_UID, stdio: ['ignore', 'pipe', 'inherit'] });
}

describeAsRoot('gRPC calls started in turns shared over uids', () => {
  it("starts another uid's call within a few of one uid's pipelined calls", async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-fair-calls-'));
    fs.chmodSync(dir, 0o755);
    const socket = path.join(dir, 'grpc.sock');
    const log = pino({ level: 'silent' });
    const deps: HandlerDeps = {
      sessions: new SessionManager(log),
      access: new AccessPolicy({ allowUids: [], allowGids: [], adminUids: [0], adminGids: [] }),
      streamStallMs: 1_000,
      log,
      fair: new FairCalls(),
    };
    let floodStarted = 0;
    const atVictimStart: number[] = [];
    const server = new grpc.Server();
    server.addService(loadProtos().proto.vmmd.v1.Devices.service, {
      ListDevices: unary(deps, 'ListDevices', (_request: unknown, context) => {
        if (context.who?.peer?.uid === FLOOD_UID) floodStarted++;
        else atVictimStart.push(floodStarted);
        return { devices: [] };
      }),
    });
    const listener = await GrpcUnixListener.listen(server, socket, log);
    fs.chmodSync(socket, 0o666);
    const flooder = flood(socket);
    const victim = new (loadProtos().proto.vmmd.v1.Devices)(`unix://${socket}`, grpc.credentials.createInsecure());
    try {
      await new Promise<void>((resolve) => flooder.stdout!.once('data', () => resolve()));
      const waited: number[] = [];
      for (let i = 0; i < VICTIM_CALLS; i++) {
        // Time for the flood to have its calls pipelined again.
        await new Promise((resolve) => setTimeout(resolve, 100));
        const atSend = floodStarted;
        await new Promise<void>((resolve, reject) => victim.ListDevices({}, (error: Error | null) => (error ? reject(error) : resolve())));
        waited.push(atVictimStart[atVictimStart.length - 1] - atSend);
      }
      waited.sort((a, b) => a - b);
      const median = waited[VICTIM_CALLS >> 1];
      const worst = waited[VICTIM_CALLS - 1];
      expect(floodStarted).toBeGreaterThan(IN_FLIGHT);
      expect({ median: median <= 2 * CALLS_PER_UID_TURN, worst: worst <= 4 * CALLS_PER_UID_TURN, waited }).toMatchObject({ median: true, worst: true });
    } finally {
      flooder.kill('SIGKILL');
      victim.close();
      listener.close();
      server.forceShutdown();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
