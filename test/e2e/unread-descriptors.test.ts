/**
 * Answers carrying a descriptor that a client does not read count against the
 * daemon's own uid in the kernel (unix_inflight) until read; past the
 * daemon's RLIMIT_NOFILE the kernel refuses every descriptor it sends
 * (ETOOMANYREFS), to every uid. Run with the daemon as deployed: its own uid,
 * no capabilities (root is exempt from the kernel's limit), and a low
 * descriptor limit. One uid's sessions ask for far more opens than the limit
 * and read nothing: they are refused BUDGET_EXCEEDED past their uid's budget,
 * and another uid's session still gets its descriptors. Needs root to start
 * the daemon and the victim as other uids.
 */
import { connect, VmmdClient } from '../../client';
import { socketPaths } from '../../common/paths';
import { encodeClientFrame, PROTOCOL_VERSION } from '../../common/protocol';
import { addon } from '../../native';
import { SeqpacketConnection, SeqpacketMessage } from '../../native/seqpacket';
import { flatFrame, Peer, TestDaemon } from './harness';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
const DAEMON_UID = 4343;
const DESCRIPTOR_LIMIT = 256;
const PER_UID = 100;
const SESSIONS = 8;
const OPENS = 50;

const describeAsRoot = isRoot ? describe : describe.skip;
if (!isRoot) console.warn('not root: the daemon cannot run as its own uid; the unread-descriptors test is skipped');

jest.setTimeout(120_000);

/** A session whose socket is never read while the test says so: each answer stays queued, its descriptor in flight. */
function silentSession(dir: string): { connection: SeqpacketConnection; readAll(): Array<{ type: string; code?: string }> } {
  const connection = SeqpacketConnection.connect(socketPaths(dir).session);
  connection.send(encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION } }));
  // The first readable callback stops the poller, and nothing reads until readAll.
  connection.scheduleReads(() => undefined);
  return {
    connection,
    readAll() {
      const messages: Array<{ type: string; code?: string }> = [];
      connection.on('message', (message: SeqpacketMessage) => {
        if (message.fd >= 0) addon.close(message.fd);
        messages.push(flatFrame(message.data) as { type: string });
      });
      while (connection.readMessages(1024) === 'more');
      return messages;
    },
  };
}

describeAsRoot('descriptors in flight', () => {
  let daemon: TestDaemon | undefined;
  let owner: VmmdClient | undefined;
  let victim: Peer | undefined;
  afterEach(async () => {
    await victim?.stop();
    owner?.close();
    await daemon?.stop();
  });

  it("refuses one uid's opens past its budget of unread descriptors, and another uid still gets its own", async () => {
    daemon = await TestDaemon.start(
      ['--socket-group', String(NOBODY), '--host-granularity', '64KiB', '--max-unread-descriptors-per-uid', String(PER_UID)],
      'host',
      {},
      { descriptorLimit: DESCRIPTOR_LIMIT, as: { uid: DAEMON_UID, gid: NOBODY } },
    );
    owner = await connect({ socketDir: daemon.dir });
    const allocation = await owner.vmm.create({ size: 64 << 10 });
    await owner.stores.createStore({ allocationId: allocation.id, name: 'bait' });
    const silent = Array.from({ length: SESSIONS }, () => silentSession(daemon!.dir));
    let request = 1;
    for (const { connection } of silent) {
      for (let i = 0; i < OPENS; i++) connection.send(encodeClientFrame({ request: String(request++), open: { store: { name: 'bait' } } }));
    }
    // Well past the kernel's limit asked for; give the daemon time to answer them all.
    const asked = SESSIONS * OPENS;
    expect(asked).toBeGreaterThan(DESCRIPTOR_LIMIT);
    await new Promise((resolve) => setTimeout(resolve, 2_000));
    victim = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
    const victimOutcomes: string[] = [];
    for (let i = 0; i < 4; i++) {
      victimOutcomes.push(
        await victim.do({ op: 'call', api: 'vmm', method: 'allocateRaw', args: { size: String(64 << 10) } }).then(
          () => 'ok',
          (error: { code?: string; message: string }) => `${error.code}: ${error.message}`,
        ),
      );
    }
    const answers = silent.flatMap((session) => session.readAll());
    const opened = answers.filter((answer) => answer.type === 'opened').length;
    const refused = answers.filter((answer) => answer.type === 'error' && answer.code === 'BUDGET_EXCEEDED').length;
    for (const { connection } of silent) connection.close();
    expect({ victimOutcomes, opened, refusedRest: refused === asked - opened }).toEqual({
      victimOutcomes: ['ok', 'ok', 'ok', 'ok'],
      opened: PER_UID,
      refusedRest: true,
    });
  });
});
