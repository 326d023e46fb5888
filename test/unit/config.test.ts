import { ConfigError, parseBytes, parseCommandLine } from '../../server/app/config';

const PAGE = 4096;

function run(argv: string[], env: NodeJS.ProcessEnv = {}) {
  const parsed = parseCommandLine(argv, { VMMD_SOCKET_DIR: '/tmp/x', ...env }, PAGE);
  if (parsed.kind !== 'run') throw new Error(`expected run, got ${parsed.kind}`);
  return parsed.config;
}

describe('parseBytes', () => {
  it.each([
    ['4096', 4096n],
    ['2MiB', 2n << 20n],
    ['2M', 2n << 20n],
    ['1g', 1n << 30n],
    ['3GB', 3_000_000_000n],
    ['1TiB', 1n << 40n],
  ])('%s is %s', (text, bytes) => expect(parseBytes('--x', text)).toBe(bytes));
  it.each(['', '-1', '1.5G', '2 parsecs', '0x10'])('refuses %j naming the key', (text) =>
    expect(() => parseBytes('--host-capacity', text)).toThrow(/^--host-capacity: /),
  );
});

describe('parseCommandLine', () => {
  it('defaults to auto, 2 MiB granularity and info', () => {
    const config = run([]);
    expect(config).toMatchObject({ backend: 'auto', hostGranularity: 2n << 20n, logLevel: 'info', socketDir: '/tmp/x' });
    expect(config.hostCapacity % config.hostGranularity).toBe(0n);
  });
  it('takes flags over environment', () => {
    expect(run(['--backend', 'host'], { VMMD_BACKEND: 'cuda' }).backend).toBe('host');
    expect(run([], { VMMD_BACKEND: 'host' }).backend).toBe('host');
    expect(run(['--socket-dir', '/tmp/y']).socketDir).toBe('/tmp/y');
    expect(run(['--host-capacity', '64MiB']).hostCapacity).toBe(64n << 20n);
  });
  it.each([
    [['--backend', 'gpu'], /--backend: "gpu" is not one of auto, host, cuda/],
    [['--host-granularity', '3K'], /--host-granularity: 3072 must be a power of two/],
    [['--host-granularity', '2048'], /multiple of the page size 4096/],
    [['--host-capacity', '1M'], /--host-capacity: 1048576 must be at least the granularity/],
    [['--log-level', 'loud'], /--log-level: "loud"/],
    [['--frobnicate'], /frobnicate/],
  ])('refuses %j', (argv, message) => {
    expect(() => run(argv)).toThrow(ConfigError);
    expect(() => run(argv)).toThrow(message);
  });
  it('names the environment variable when the value came from there', () => {
    expect(() => run([], { VMMD_HOST_CAPACITY: 'lots' })).toThrow(/^VMMD_HOST_CAPACITY: /);
  });
  it('answers --help and --version', () => {
    expect(parseCommandLine(['--help'], {}, PAGE).kind).toBe('help');
    expect(parseCommandLine(['-v'], {}, PAGE).kind).toBe('version');
  });
});

describe('the config file', () => {
  const fs = require('node:fs') as typeof import('node:fs');
  const os = require('node:os') as typeof import('node:os');
  const path = require('node:path') as typeof import('node:path');
  function file(content: string): string {
    const name = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-config-')), 'vmmd.json');
    fs.writeFileSync(name, content);
    return name;
  }

  it('gives settings below flags and environment', () => {
    const config = file(JSON.stringify({ hostCapacity: '64MiB', allowUids: [0, 1000], quotaPerSession: '8MiB', logLevel: 'warn' }));
    const parsed = run(['--config', config, '--log-level', 'error']);
    expect(parsed).toMatchObject({ hostCapacity: 64n << 20n, allowUids: [0, 1000], quotaPerSession: 8n << 20n, logLevel: 'error' });
    expect(run([], { VMMD_CONFIG: config, VMMD_HOST_CAPACITY: '128MiB' }).hostCapacity).toBe(128n << 20n);
  });

  it.each([
    ['{"hostCapacity": "lots"}', /vmmd\.json: hostCapacity: "lots" is not a byte count/],
    ['{"colour": "blue"}', /unknown key "colour"/],
    ['not json', /not JSON/],
    ['[1]', /must hold a JSON object/],
    ['{"allowUids": ["root"]}', /allowUids: "root" is not an integer/],
    ['{"tcpListen": "0.0.0.0:7000"}', /tcpListen: the TCP listener is TLS only/],
  ])('refuses %s, naming the key', (content, message) => {
    expect(() => run(['--config', file(content)])).toThrow(message);
  });

  it('refuses a config file that cannot be read', () => {
    expect(() => run(['--config', '/nonexistent/vmmd.json'])).toThrow(/--config: cannot read/);
  });
});

describe('--turn-cpu', () => {
  it('is on by default', () => expect(run([]).turnCpu).toBe(true));
  it('takes on/off or true/false from the flag, else VMMD_TURN_CPU', () => {
    expect(run(['--turn-cpu', 'on']).turnCpu).toBe(true);
    expect(run(['--turn-cpu', 'false'], { VMMD_TURN_CPU: 'on' }).turnCpu).toBe(false);
    expect(run([], { VMMD_TURN_CPU: 'true' }).turnCpu).toBe(true);
  });
  it.each(['yes', '1', ''])('refuses %j naming the flag and the values it takes', (text) =>
    expect(() => run(['--turn-cpu', text])).toThrow(/--turn-cpu: ".*" is not one of on, off, true, false/),
  );
});

describe('--busy-poll-us', () => {
  it('defaults to 200 µs', () => expect(run([]).busyPollMicros).toBe(200));
  it('takes the flag, else VMMD_BUSY_POLL_US; 0 turns it off', () => {
    expect(run(['--busy-poll-us', '0']).busyPollMicros).toBe(0);
    expect(run([], { VMMD_BUSY_POLL_US: '350' }).busyPollMicros).toBe(350);
    expect(run(['--busy-poll-us', '50'], { VMMD_BUSY_POLL_US: '350' }).busyPollMicros).toBe(50);
  });
  it.each(['-1', '10001', '2.5', 'fast'])('refuses %j naming the flag', (text) => expect(() => run(['--busy-poll-us', text])).toThrow(/--busy-poll-us/));
});

describe('the per-uid budgets', () => {
  it('are derived at start unless set', () => {
    expect(run([])).toMatchObject({
      maxMappingsPerUid: undefined,
      maxReservationsPerUid: undefined,
      maxAddressSpacePerUid: undefined,
      maxStoresPerUid: undefined,
      maxAllocationsPerUid: undefined,
    });
  });
  it('are read from flags, else the environment, else the config file; 0 is no limit', () => {
    expect(
      run([
        '--max-mappings-per-uid',
        '64',
        '--max-reservations-per-uid',
        '0',
        '--max-address-space-per-uid',
        '1TiB',
        '--max-stores-per-uid',
        '8',
        '--max-allocations-per-uid',
        '16',
      ]),
    ).toMatchObject({
      maxMappingsPerUid: 64,
      maxReservationsPerUid: 0,
      maxAddressSpacePerUid: 1n << 40n,
      maxStoresPerUid: 8,
      maxAllocationsPerUid: 16,
    });
    expect(run([], { VMMD_MAX_STORES_PER_UID: '5' }).maxStoresPerUid).toBe(5);
    const fs = require('node:fs') as typeof import('node:fs');
    const os = require('node:os') as typeof import('node:os');
    const path = require('node:path') as typeof import('node:path');
    const config = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-config-')), 'vmmd.json');
    fs.writeFileSync(config, JSON.stringify({ maxAllocationsPerUid: 7, maxAddressSpacePerUid: '2GiB' }));
    expect(run(['--config', config])).toMatchObject({ maxAllocationsPerUid: 7, maxAddressSpacePerUid: 2n << 30n });
  });
  it.each([
    [['--max-mappings-per-uid=-1'], /--max-mappings-per-uid: "-1" is not an integer from 0 to 100000000/],
    [['--max-allocations-per-uid', 'many'], /--max-allocations-per-uid: "many" is not an integer/],
    [['--max-address-space-per-uid', '256TiB'], /--max-address-space-per-uid: 281474976710656 is more than the 140737488355328 bytes/],
  ])('refuse %j naming the key and the bounds', (argv, message) => expect(() => run(argv)).toThrow(message));
});

describe('the transport budgets', () => {
  it('default to 16 server and 8 client streams, 256 KiB in flight, 2 MiB messages, 64 connections, 512 and 4096 unread descriptors, 256 MiB of staging', () => {
    expect(run([])).toMatchObject({
      maxServerStreamsPerUid: 16,
      maxClientStreamsPerUid: 8,
      streamBytesInFlight: 256n << 10n,
      maxMessageBytes: 2n << 20n,
      maxConnectionsPerUid: 64,
      maxUnreadDescriptorsPerSession: 512,
      maxUnreadDescriptorsPerUid: 4096,
      maxStagingBytesPerUid: 256n << 20n,
    });
  });
  it('take the flag, else the environment', () => {
    expect(run(['--max-server-streams-per-uid', '4'], { VMMD_MAX_SERVER_STREAMS_PER_UID: '9' }).maxServerStreamsPerUid).toBe(4);
    expect(run([], { VMMD_MAX_CONNECTIONS_PER_UID: '9' }).maxConnectionsPerUid).toBe(9);
    expect(run(['--stream-bytes-in-flight', '64KiB']).streamBytesInFlight).toBe(64n << 10n);
    expect(run([], { VMMD_MAX_MESSAGE_BYTES: '4MiB' }).maxMessageBytes).toBe(4n << 20n);
    expect(run(['--max-unread-descriptors-per-uid', '100']).maxUnreadDescriptorsPerUid).toBe(100);
    expect(run(['--max-staging-bytes-per-uid', '0']).maxStagingBytesPerUid).toBe(0n);
    expect(run([], { VMMD_MAX_STAGING_BYTES_PER_UID: '64MiB' }).maxStagingBytesPerUid).toBe(64n << 20n);
  });
  it.each([
    ['--max-client-streams-per-uid', '0'],
    ['--max-unread-descriptors-per-session', '0'],
    ['--stream-bytes-in-flight', '1KiB'],
    ['--max-message-bytes', '1MiB'],
    ['--max-message-bytes', '1GiB'],
    ['--max-staging-bytes-per-uid', '2TiB'],
  ])('refuse %s %s naming the flag', (flag, text) => expect(() => run([flag, text])).toThrow(new RegExp(`^${flag}`)));
});

describe('--socket-group', () => {
  const groupFile = require('node:fs').readFileSync('/etc/group', 'utf8') as string;
  const video = /^video:[^:]*:(\d+):/m.exec(groupFile);
  (video ? it : it.skip)('takes a group name, resolved through /etc/group, as well as a gid', () => {
    expect(run(['--socket-group', 'video']).socketGroup).toBe(Number(video![1]));
    expect(run(['--socket-group', '2000']).socketGroup).toBe(2000);
  });
  it('refuses a name no group has, naming it and where it looked', () => {
    expect(() => run(['--socket-group', 'no-such-group-here'])).toThrow(/^--socket-group: "no-such-group-here" is neither a gid nor a group in \/etc\/group/);
  });
});

describe('--take-over and --park held', () => {
  it('are off and auto by default; a take-over holds what it takes', () => {
    expect(run([])).toMatchObject({ takeOver: false, park: 'auto' });
    expect(run(['--take-over', 'on'])).toMatchObject({ takeOver: true, park: 'held' });
    expect(run([], { VMMD_TAKE_OVER: 'on', VMMD_PARK: 'held' })).toMatchObject({ takeOver: true, park: 'held' });
    expect(run(['--park', 'held'])).toMatchObject({ takeOver: false, park: 'held' });
  });
  it('refuses a take-over that would hold nothing, or the keeper taking over', () => {
    expect(() => run(['--take-over', 'on', '--park', 'off'])).toThrow(/^--take-over: a daemon that takes over holds what it takes; --park off holds nothing$/);
    expect(() => run(['--take-over', 'on', '--keeper', 'on'])).toThrow(
      /^--take-over: the keeper takes over nothing; under it an upgrade is SIGHUP to the keeper$/,
    );
    expect(() => run(['--park', 'kept'])).toThrow(/--park/);
  });
});
