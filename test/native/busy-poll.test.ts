/**
 * Busy polling (native/src/busy_poll.cc, native/busy-poll.ts): an event loop
 * that spins before it sleeps meets the next message awake, never runs past
 * a timer, and spins only while it is asked to.
 */
import { ChildProcess, fork } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { addon } from '../../native';
import { busyPollAlways, busyPollStats, busyPollWhile } from '../../native/busy-poll';
import { SeqpacketConnection } from '../../native/seqpacket';

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** An echo peer in another process, spinning `micros` before it sleeps. */
function echoPeer(socket: string, micros: number): Promise<ChildProcess> {
  const script = `
    const { addon } = require(${JSON.stringify(path.resolve(__dirname, '../../dist/native/index.js'))});
    const { SeqpacketConnection } = require(${JSON.stringify(path.resolve(__dirname, '../../dist/native/seqpacket.js'))});
    addon.busyPoll(${micros});
    const listening = addon.seqpacketListen(${JSON.stringify(socket)}, 4);
    const poller = new addon.Poller(listening, () => {
      const peer = addon.seqpacketAccept(listening);
      if (!peer) return;
      const connection = new SeqpacketConnection(peer.fd);
      connection.on('message', (message) => connection.send(message.data));
      connection.on('close', () => process.exit(0));
    });
    poller.start();
    process.send('ready');`;
  const child = fork('-e', [script], { execArgv: [], stdio: ['ignore', 'inherit', 'inherit', 'ipc'] } as never);
  return new Promise((resolve, reject) => {
    child.once('message', () => resolve(child));
    child.once('exit', (code) => reject(new Error(`echo peer exited with ${code}`)));
  });
}

async function roundTrips(connection: SeqpacketConnection, count: number): Promise<void> {
  for (let i = 0; i < count; i++) {
    await new Promise<void>((resolve) => {
      connection.once('message', () => resolve());
      connection.send(Buffer.from('x'));
    });
  }
}

describe('busy polling', () => {
  afterEach(() => busyPollAlways(0));

  it('refuses a budget that is not a number of microseconds from 0 to 1 s, naming it', () => {
    expect(() => addon.busyPoll(-1)).toThrow(/between 0 and 1000000, got -1/);
    expect(() => addon.busyPoll(2_000_000)).toThrow(/between 0 and 1000000/);
    expect(() => (addon.busyPoll as (value: unknown) => void)('fast')).toThrow(/must be a number/);
  });

  it('spins before sleeping only while a budget is set, and meets the answer of a peer awake', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-busy-'));
    const socket = path.join(dir, 'echo.sock');
    const peer = await echoPeer(socket, 200);
    const connection = SeqpacketConnection.connect(socket);
    try {
      const off0 = busyPollStats();
      await roundTrips(connection, 50);
      const off1 = busyPollStats();
      expect(off1.spins).toBe(off0.spins);

      busyPollAlways(500);
      await roundTrips(connection, 200);
      const on = busyPollStats();
      expect(on.spins).toBeGreaterThan(off1.spins);
      // Most round trips end with the answer met while spinning (a machine this busy still meets some).
      expect(on.caught - off1.caught).toBeGreaterThan(20);
      expect(on.spunMicroseconds).toBeGreaterThan(off1.spunMicroseconds);
    } finally {
      connection.close();
      await new Promise((resolve) => peer.once('exit', resolve));
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  it('never spins past a timer that is due: a 1 s budget still lets a 5 ms timer fire on time', async () => {
    busyPollAlways(1_000_000);
    const delays: number[] = [];
    for (let i = 0; i < 20; i++) {
      const start = performance.now();
      await sleep(5);
      delays.push(performance.now() - start);
    }
    busyPollAlways(0);
    delays.sort((a, b) => a - b);
    // Spinning up to the timer, not past it: the median wait stays near 5 ms (a sleeping loop's too).
    expect(delays[10]).toBeLessThan(50);
  });

  it('spins while a request is in flight, with the largest budget asked, and stops when the last is answered', () => {
    const calls: number[] = [];
    const spy = jest.spyOn(addon, 'busyPoll').mockImplementation((micros: number) => void calls.push(micros));
    try {
      const first = busyPollWhile(100);
      const second = busyPollWhile(300);
      first();
      first();
      expect(calls).toEqual([100, 300]);
      second();
      expect(calls).toEqual([100, 300, 0]);
      busyPollWhile(0)();
      expect(calls).toEqual([100, 300, 0]);
      busyPollAlways(50);
      const third = busyPollWhile(20);
      third();
      expect(calls).toEqual([100, 300, 0, 50, 50, 50]);
    } finally {
      spy.mockRestore();
    }
  });
});

describe("the client's budget (connect's busyPollMicros)", () => {
  const { busyPollBudget } = require('../../client/connection') as typeof import('../../client/connection');
  it('is the option, else VMMD_CLIENT_BUSY_POLL_US, else 200', () => {
    expect(busyPollBudget(undefined, undefined)).toBe(200);
    expect(busyPollBudget(undefined, '0')).toBe(0);
    expect(busyPollBudget(75, '0')).toBe(75);
  });
  it.each([
    [-1, undefined],
    [1.5, undefined],
    [20_000, undefined],
    [undefined, 'soon'],
  ])('refuses %j / %j with INVALID_ARGUMENT naming the value', (option, env) => {
    expect(() => busyPollBudget(option, env)).toThrow(/must be a whole number of microseconds from 0 to 10000/);
  });
});
