/**
 * One uid against another's budgets and memory, on the host backend: an
 * attacker uid (nobody) uses only what the daemon lets any allowed uid do
 * (open a store by name, use a share key it was given) to take what the
 * victim uid is owed: its store budget, or the use of its own memory. Peers
 * of other uids need root.
 */
import { connect, VmmdClient } from '../../client';
import { call as rawCall, MiB, Peer, stopWhenClean, TestDaemon } from './harness';

const NOBODY = 65534;
const VICTIM = { uid: 1001, gid: NOBODY };
const SIZE = 2n * MiB;
const STORES = 3;
const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];
const peers: Peer[] = [];

afterEach(async () => {
  for (const peer of peers.splice(0)) await peer.kill();
  await stopWhenClean(daemon, clients);
  daemon = undefined;
});

async function peer(as: { uid: number; gid: number }): Promise<Peer> {
  const started = await Peer.start(daemon!.dir, as);
  peers.push(started);
  return started;
}

const call = <T = any>(who: Peer, api: string, method: string, args: object) => who.do<T>({ op: 'call', api, method, args });

/** Each budget's use by a uid, from an admin's report. */
async function budgetsOf(uid: number): Promise<Record<string, number>> {
  const report = JSON.parse((await rawCall(daemon!.raw.admin, 'GetReport', {})).json);
  const used: Record<string, number> = {};
  for (const [name, budget] of Object.entries(report.budgets as Record<string, { used: Record<string, number> }>)) {
    if (budget.used[uid] !== undefined) used[name] = budget.used[uid];
  }
  return used;
}

describe("another uid against a victim's budgets and memory (host, run as root)", () => {
  // Detach ends what the maker is charged for: the daemon lets go of the store's memory, and a store still open counts against its openers.
  it('a store another uid keeps open after its maker detached it no longer counts against the maker', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-gids', String(NOBODY), '--max-stores-per-uid', String(STORES)]);
    const victim = await peer(VICTIM);
    const attacker = await peer({ uid: NOBODY, gid: NOBODY });
    const allocation = await call(victim, 'vmm', 'create', { size: String(SIZE) });
    const opens: Array<{ handle: number }> = [];
    for (let i = 0; i < STORES; i++) {
      const store = await call(victim, 'stores', 'createStore', { allocationId: allocation.id, name: `victim-${i}` });
      opens.push(await attacker.do<{ handle: number }>({ op: 'storeOpen', name: `victim-${i}` }));
      await call(victim, 'stores', 'detach', { id: store.id });
    }
    // The victim holds no live store: it may make one.
    await expect(call(victim, 'stores', 'createStore', { allocationId: allocation.id, name: 'victim-again' })).resolves.toMatchObject({ name: 'victim-again' });
    expect((await budgetsOf(VICTIM.uid))['stores per uid']).toBe(1);
    // The opens are the attacker's to pay for: a store each of its uid, until it closes them.
    expect((await budgetsOf(NOBODY))['stores per uid']).toBe(STORES);
    await expect(
      call(attacker, 'stores', 'createStore', { allocationId: (await call(attacker, 'vmm', 'create', { size: String(SIZE) })).id, name: 'attacker' }),
    ).rejects.toMatchObject({ code: 'BUDGET_EXCEEDED' });
    for (const open of opens) await attacker.do({ op: 'storeClose', handle: open.handle });
    expect((await budgetsOf(NOBODY))['stores per uid']).toBeUndefined();
  });

  // A share key's holder gets a writable descriptor, and a writable descriptor can add seals: the daemon freezes the seals (F_SEAL_SEAL) first.
  it("a share key's holder cannot seal the owner's memory against the owner's writes", async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY)]);
    const owner = await connect({ socketDir: daemon.dir });
    clients.push(owner);
    const allocation = await owner.vmm.create({ size: SIZE });
    const { shareKey } = await owner.vmm.share({ allocationId: allocation.id });
    const holder = await peer({ uid: NOBODY, gid: NOBODY });
    // The holder tries every way of changing the memory through its descriptor, F_ADD_SEALS F_SEAL_WRITE among them:
    // it may write the memory (the key says so), not seal it.
    const views = await holder.do<Record<string, string>>({ op: 'writableViews', allocationId: allocation.id, shareKey, size: String(SIZE) });
    expect(views).toMatchObject({ write: 'ok', writableMapping: 'ok', grow: 'EPERM', shrink: 'EPERM', seal: 'EPERM' });
    // The owner still maps its memory writable in the daemon and writes it.
    const { address } = await owner.vmm.reserve({ size: SIZE });
    await owner.vmm.map({ address, size: SIZE, allocationId: allocation.id });
    const outcome = await owner.vmm.setAccess({ address, size: SIZE, descriptors: RW }).then(
      () => 'ok',
      (error: { code?: string; message: string }) => `${error.code}: ${error.message}`,
    );
    expect(outcome).toBe('ok');
    await owner.vmm.write(address, Buffer.from('owner'));
    expect((await owner.vmm.read(address, 5)).toString()).toBe('owner');
    await owner.vmm.unmap({ address, size: SIZE });
    await owner.vmm.freeAddress({ address, size: SIZE });
    await owner.vmm.release({ allocationId: allocation.id });
  });
});
