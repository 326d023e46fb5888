/** The parked state's journal, the keeper's descriptor store and the reading of LISTEN_FDS, without a daemon. */
import * as fs from 'node:fs';
import { addon } from '../../native';
import { inheritedDescriptors, isValidFdName } from '../../server/lifecycle/fd-store';
import { Journal } from '../../server/lifecycle/journal';
import { daemonArguments, DescriptorStore } from '../../server/lifecycle/keeper';
import { emptyState, JournalLine, replay } from '../../server/lifecycle/parked-records';

const allocation = (id: string, owner = '5') =>
  ({
    t: 'a',
    a: {
      id,
      fd: `m${id}`,
      owner,
      device: 0,
      deviceUuid: '',
      location: { type: 'DEVICE', id: 0 },
      size: '2097152',
      handleTypes: ['POSIX_FD'],
      imported: false,
      references: [[owner, 1]],
    },
    next: String(Number(id) + 1),
  }) as JournalLine;

describe('the journal', () => {
  it('keeps the last line of each object, and skips a last line cut short by a crash', () => {
    const lines = [allocation('1'), allocation('2'), { t: 'A', id: '1' } as JournalLine, allocation('2', '0')].map((line) => JSON.stringify(line));
    const whole = `${lines.join('\n')}\n`;
    const cut = `${whole}${JSON.stringify(allocation('3')).slice(0, 40)}`;
    const state = replay(cut);
    expect([...state.allocations.keys()]).toEqual(['2']);
    expect(state.allocations.get('2')!.owner).toBe('0');
    expect(state.nextId).toBe(3n);
  });

  it('writes a snapshot into a memfd that reads back as the same state, and appends after it', () => {
    const state = replay(
      `${JSON.stringify(allocation('7'))}\n${JSON.stringify({ t: 's', s: { id: '1', name: 'w', owner: '0', target: 'SYSMEM', device: 0, size: '1', readOnly: true, attached: false, allocationId: '7' }, next: '2' })}\n`,
    );
    const journal = Journal.create(state);
    try {
      journal.append({ t: 'A', id: '7' });
      const back = Journal.read(journal.fd);
      expect([...back.allocations.keys()]).toEqual([]);
      expect(back.stores.get('1')!.name).toBe('w');
      expect(back.nextId).toBe(8n);
      const empty = Journal.create(emptyState());
      expect(Journal.read(empty.fd).allocations.size).toBe(0);
      empty.close();
    } finally {
      journal.close();
    }
  });
});

describe('a journal that goes on after a restart', () => {
  it('reads the state, then appends after it; a last line a crash cut short stays apart and is skipped', () => {
    const fd = addon.stateMemfdCreate('t');
    const whole = `${JSON.stringify(allocation('1'))}\n${JSON.stringify(allocation('2'))}\n`;
    fs.writeSync(fd, `${whole}${JSON.stringify(allocation('3')).slice(0, 30)}`, 0);
    const { journal, state } = Journal.resume(fd);
    try {
      expect([...state.allocations.keys()]).toEqual(['1', '2']);
      expect(journal.lines).toBe(2);
      journal.append({ t: 'A', id: '1' });
      journal.append(allocation('4'));
      const back = Journal.read(fd);
      expect([...back.allocations.keys()]).toEqual(['2', '4']);
      expect(back.nextId).toBe(5n);
      // Gone on again, from a journal that ends whole: nothing is inserted between.
      const again = Journal.resume(fd);
      again.journal.append({ t: 'A', id: '2' });
      expect([...Journal.read(fd).allocations.keys()]).toEqual(['4']);
    } finally {
      journal.close();
    }
  });
});

describe("the keeper's descriptor store", () => {
  it('keeps descriptors under their FDNAME, drops a name on FDSTOREREMOVE, and closes what came with anything else', () => {
    const store = new DescriptorStore();
    const [a, b, c] = [0, 1, 2].map(() => addon.stateMemfdCreate('t'));
    store.apply('FDSTORE=1\nFDNAME=m1', [a]);
    store.apply('FDSTORE=1\nFDNAME=m2', [b]);
    store.apply('READY=1', [c]);
    expect(() => fs.fstatSync(c)).toThrow();
    expect(store.listing()).toEqual({ fds: [a, b], names: ['m1', 'm2'] });
    store.apply('FDSTOREREMOVE=1\nFDNAME=m1', []);
    expect(() => fs.fstatSync(a)).toThrow();
    expect(store.listing().names).toEqual(['m2']);
    // A name systemd refuses (':' separates LISTEN_FDNAMES) is not stored.
    const d = addon.stateMemfdCreate('t');
    store.apply('FDSTORE=1\nFDNAME=a:b', [d]);
    expect(() => fs.fstatSync(d)).toThrow();
    expect(isValidFdName('a:b')).toBe(false);
    store.closeAll();
    expect(store.size).toBe(0);
  });

  it('starts the daemon with its own command line, without --keeper', () => {
    expect(daemonArguments(['--keeper', 'on', '--backend', 'host', '--keeper=on', '--socket-dir', '/x'])).toEqual(['--backend', 'host', '--socket-dir', '/x']);
  });
});

describe('LISTEN_FDS', () => {
  it('is taken only when LISTEN_PID is this process, and is removed from the environment either way', () => {
    const env: NodeJS.ProcessEnv = { LISTEN_FDS: '1', LISTEN_PID: String(process.pid + 1), LISTEN_FDNAMES: 'j1' };
    expect(inheritedDescriptors(env).size).toBe(0);
    expect(env.LISTEN_FDS).toBeUndefined();
  });
});
