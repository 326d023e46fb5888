/**
 * The session transport's turns are shared over uids, not sockets: one uid's
 * many sessions flooding pings, and another uid's session pinging one at a
 * time. The real transport (server/transport/session/sessions.ts) answers
 * through a recording dispatcher: each victim ping's answer says how many
 * flood messages were answered between the victim's send and its answer. A
 * per-socket share lets every flooding socket's messages in first; a per-uid
 * share answers the victim within a round or two of the flood's messages.
 * The flood runs as another uid (needs root, as CI runs).
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { encodeClientFrame, PROTOCOL_VERSION } from '../../common/protocol';
import { flatFrame } from '../e2e/harness';
import { SeqpacketConnection, SeqpacketMessage } from '../../native/seqpacket';
import { MESSAGES_PER_UID_TURN } from '../../server/transport/session/fair-share';
import { Answer, Session, SessionManager } from '../../server/transport/session/sessions';

const isRoot = process.getuid?.() === 0;
const FLOOD_UID = 4242;
const FLOOD_SESSIONS = 64;
const VICTIM_PINGS = 20;
const DIST = path.join(__dirname, '..', '..', 'dist');

const describeAsRoot = isRoot ? describe : describe.skip;
if (!isRoot) console.warn('not root: the flood cannot run as another uid; the fair-share test is skipped');

/** A process of uid FLOOD_UID holding FLOOD_SESSIONS sessions, each keeping its socket full of pings. */
function flood(socket: string) {
  const script = `
    const { SeqpacketConnection } = require(${JSON.stringify(path.join(DIST, 'native', 'seqpacket.js'))});
    const ping = Buffer.from(${JSON.stringify([...encodeClientFrame({ request: '1', ping: { nonce: 'flood' } })])});
    const hello = Buffer.from(${JSON.stringify([...encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION } })])});
    const connections = [];
    for (let i = 0; i < ${FLOOD_SESSIONS}; i++) {
      connections.push(SeqpacketConnection.connect(${JSON.stringify(socket)}));
      connections[i].send(hello);
    }
    const fill = () => { for (const c of connections) { try { while (c.send(ping)); } catch { process.exit(0); } } };
    fill();
    setInterval(fill, 1);
    process.stdout.write('flooding\\n');
  `;
  return spawn(process.execPath, ['-e', script], { uid: FLOOD_UID, gid: FLOOD_UID, stdio: ['ignore', 'pipe', 'inherit'] });
}

describeAsRoot('session turns shared over uids', () => {
  it("answers another uid's ping within a few of one flooding uid's messages, however many sessions flood", async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-fair-'));
    fs.chmodSync(dir, 0o755);
    const socket = path.join(dir, 'session.sock');
    const sessions = new SessionManager(pino({ level: 'silent' }));
    let floodAnswered = 0;
    // What the flood had been answered when each victim ping was.
    const atVictimAnswer = new Map<string, number>();
    sessions.listen(socket, {
      answer(session: Session, message): Answer {
        if (session.peer.uid === FLOOD_UID) floodAnswered++;
        else atVictimAnswer.set(String(message.ping?.nonce), floodAnswered);
        return { reply: { request: message.request, pong: { nonce: message.ping?.nonce } } };
      },
      reclaim: async () => undefined,
      methodOf: () => 'Ping',
    });
    fs.chmodSync(socket, 0o666);
    const flooder = flood(socket);
    try {
      await new Promise<void>((resolve) => flooder.stdout!.once('data', () => resolve()));
      await new Promise<void>((resolve) => {
        const waitForFlood = () => (floodAnswered > 10 * FLOOD_SESSIONS ? resolve() : setTimeout(waitForFlood, 5));
        waitForFlood();
      });
      const victim = SeqpacketConnection.connect(socket);
      victim.send(encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION } }));
      const inbox: Array<{ type: string; nonce?: string }> = [];
      let wake: (() => void) | undefined;
      victim.on('message', (message: SeqpacketMessage) => {
        inbox.push(flatFrame(message.data) as { type: string });
        wake?.();
      });
      const next = async () => {
        while (inbox.length === 0) await new Promise<void>((resolve) => (wake = resolve));
        return inbox.shift()!;
      };
      expect((await next()).type).toBe('hello');
      const waited: number[] = [];
      for (let i = 0; i < VICTIM_PINGS; i++) {
        const atSend = floodAnswered;
        victim.send(encodeClientFrame({ request: String(i + 1), ping: { nonce: String(i) } }));
        expect(await next()).toEqual({ type: 'pong', request: String(i + 1), nonce: String(i) });
        waited.push(atVictimAnswer.get(String(i))! - atSend);
      }
      victim.close();
      waited.sort((a, b) => a - b);
      // The flood kept going all along, and each victim ping waited for at most a few of its rounds.
      expect(floodAnswered).toBeGreaterThan(VICTIM_PINGS * MESSAGES_PER_UID_TURN);
      const median = waited[VICTIM_PINGS >> 1];
      const worst = waited[VICTIM_PINGS - 1];
      expect({ median: median <= 2 * MESSAGES_PER_UID_TURN, worst: worst <= 4 * MESSAGES_PER_UID_TURN, waited }).toMatchObject({ median: true, worst: true });
    } finally {
      flooder.kill('SIGKILL');
      await sessions.close();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
