/**
 * The daemon's configuration: each setting of common/daemon-settings.ts read
 * from its flag, else its environment variable, else the JSON config file
 * (--config), else its default, parsed by its declared type within its
 * bounds. Invalid values fail at start with the key named. `--help` is
 * generated from the same table; what ties settings together (granularity and
 * capacity, TLS for TCP, distinct ports) is checked here.
 */
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import { parseArgs } from 'node:util';
import { defaultSocketDir } from '../../common/paths';
import { DAEMON_SETTINGS, MAX_ID, type SettingDeclaration, type SettingKey, shownDefault } from '../../common/daemon-settings';
import { type BackendChoice, defaultStock } from '../backends/select';
import type { StockLevel } from '../backends/stock-shelves';

export { defaultStock };
export type { BackendChoice, StockLevel };

export interface TlsConfig {
  cert: string;
  key: string;
  /** With a CA, clients must present a certificate it signed (mutual TLS). */
  ca?: string;
}

export interface DaemonConfig {
  backend: BackendChoice;
  socketDir: string;
  hostCapacity: bigint;
  hostGranularity: bigint;
  logLevel: string;
  /** Group given the socket directory and sockets (mode 0750 / 0660); none: owner only (0700 / 0600). */
  socketGroup?: number;
  /** Peers allowed on the session socket, by uid or gid (primary or supplementary); both empty: everyone who can reach it. */
  allowUids: number[];
  allowGids: number[];
  /** Peers that may act daemon-wide (ClearCaches, GetReport, others' sessions and objects, calls without a session that change anything), by uid or gid (primary or supplementary). */
  adminUids: number[];
  adminGids: number[];
  /** Sessions one uid may hold open at once. */
  maxSessionsPerUid: number;
  /** Received, unclaimed descriptors one uid's sessions may hold at once (each session: at most 64 too). */
  maxTransfersPerUid: number;
  /** How long a server stream (Read) waits for a reader that takes nothing before it ends the call. */
  streamStallMs: number;
  /**
   * What one uid may make the daemon hold at once (0: no limit; undefined:
   * derived at start from vm.max_map_count and the descriptor limit,
   * server/registry/uid-budgets.ts).
   */
  maxMappingsPerUid?: number;
  maxReservationsPerUid?: number;
  maxAddressSpacePerUid?: bigint;
  maxStoresPerUid?: number;
  maxAllocationsPerUid?: number;
  /** The transport's budgets (server/transport/budgets.ts): streams, connections and unread descriptors per uid. */
  maxServerStreamsPerUid: number;
  maxClientStreamsPerUid: number;
  streamBytesInFlight: bigint;
  maxConnectionsPerUid: number;
  maxUnreadDescriptorsPerSession: number;
  maxUnreadDescriptorsPerUid: number;
  /** Bytes of staging buffers one uid may have the daemon map at once (0: no limit). */
  maxStagingBytesPerUid: bigint;
  /** The largest gRPC message the daemon receives (a Write's chunk). */
  maxMessageBytes: bigint;
  /** Bytes a uid, and a session, may hold in allocations at once (0: no limit). */
  quotaPerUid: bigint;
  quotaPerSession: bigint;
  /** How long Import and Attach wait for a descriptor not yet received. */
  transferWaitMs: number;
  /** Prometheus metrics on metricsAddress:PORT/metrics (0: off). */
  metricsPort: number;
  /** The address metrics and the health port listen on: 127.0.0.1 by default, 0.0.0.0 (or ::) for a scraper on another host. */
  metricsAddress: string;
  /** Only grpc.health.v1.Health, plaintext, on metricsAddress:PORT, for Kubernetes gRPC probes (0: off). */
  healthPort: number;
  /** An extra gRPC listener over TCP, TLS only, never carrying descriptors ('' : off). */
  tcpListen: string;
  tls?: TlsConfig;
  /** How long SIGTERM waits for calls in flight before cutting them. */
  shutdownGraceMs: number;
  /** Allocations created and exported ahead, per device ('auto': the backend's default). */
  stock: StockLevel[] | 'auto';
  /** How long the event loop spins for the next message before it sleeps, in microseconds (0: never; native/busy-poll.ts). */
  busyPollMicros: number;
  /** Whether each turn is measured by the event-loop thread's CPU time too (two CLOCK_THREAD_CPUTIME_ID reads a turn), not only by wall clock. */
  turnCpu: boolean;
  /** Park memory and records in the file-descriptor store named by NOTIFY_SOCKET ('held': else in the daemon itself; 'off': never). */
  park: 'auto' | 'held' | 'off';
  /** Start by taking over from the daemon serving the same socket directory (server/lifecycle/hand-over.ts). */
  takeOver: boolean;
  /** Run as the keeper in front of the serving daemon (server/lifecycle/keeper.ts). */
  keeper: boolean;
  /** After a restart, how long a parked session's objects wait for it. */
  parkedGraceMs: number;
}

/** "2MiB:4,32MiB:2" → levels; "none" → []; "auto" stays. @throws ConfigError naming the key */
export function parseStock(key: string, text: string): StockLevel[] | 'auto' {
  const trimmed = text.trim();
  if (trimmed === 'auto') return 'auto';
  if (trimmed === 'none' || trimmed === '') return [];
  return trimmed.split(',').map((part) => {
    const match = /^([^:]+):(.+)$/.exec(part.trim());
    if (!match) throw new ConfigError(`${key}: "${part}" is not SIZE:DEPTH (e.g. 2MiB:4)`);
    const size = parseBytes(key, match[1]);
    if (size === 0n) throw new ConfigError(`${key}: the size in "${part}" must be greater than 0`);
    return { size, depth: parseInteger(key, match[2], 1, 64) };
  });
}

export class ConfigError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ConfigError';
  }
}

const UNITS: Record<string, bigint> = {
  '': 1n,
  B: 1n,
  K: 1n << 10n,
  KIB: 1n << 10n,
  M: 1n << 20n,
  MIB: 1n << 20n,
  G: 1n << 30n,
  GIB: 1n << 30n,
  T: 1n << 40n,
  TIB: 1n << 40n,
  KB: 1000n,
  MB: 1000n ** 2n,
  GB: 1000n ** 3n,
  TB: 1000n ** 4n,
};

/** "2MiB" → 2097152n. @throws ConfigError naming the key */
export function parseBytes(key: string, text: string): bigint {
  const match = /^\s*([0-9]+)\s*([a-zA-Z]*)\s*$/.exec(text);
  const unit = match ? UNITS[match[2].toUpperCase()] : undefined;
  if (!match || unit === undefined) {
    throw new ConfigError(`${key}: "${text}" is not a byte count (a number with an optional K, MiB, GB… suffix)`);
  }
  return BigInt(match[1]) * unit;
}

function parseInteger(key: string, text: string, min: number, max: number): number {
  if (!/^\s*\d+\s*$/.test(text) || Number(text) < min || Number(text) > max) {
    throw new ConfigError(`${key}: "${text}" is not an integer from ${min} to ${max}`);
  }
  return Number(text);
}

function parseIdList(key: string, text: string, max: number): number[] {
  if (text.trim() === '') return [];
  return text.split(',').map((part) => parseInteger(key, part, 0, max));
}

const SWITCH_VALUES: Record<string, boolean> = { on: true, off: false, true: true, false: false };

/** A gid, or a group name looked up in /etc/group (what users type: video, vmmd). @throws ConfigError naming the key */
function parseGroup(key: string, text: string): number {
  if (/^\s*\d+\s*$/.test(text)) return parseInteger(key, text, 0, 2 ** 32 - 2);
  let groups = '';
  try {
    groups = fs.readFileSync('/etc/group', 'utf8');
  } catch {
    // no /etc/group: no names to resolve
  }
  const entry = groups
    .split('\n')
    .map((line) => line.split(':'))
    .find((fields) => fields[0] === text.trim() && fields.length >= 3);
  if (entry === undefined) throw new ConfigError(`${key}: "${text}" is neither a gid nor a group in /etc/group`);
  return Number(entry[2]);
}

/** The value a setting's text stands for, by its declared type. @throws ConfigError naming `key` */
function parseSetting(setting: SettingDeclaration, key: string, text: string): number | bigint | number[] | string | boolean {
  switch (setting.type) {
    case 'integer':
      return parseInteger(key, text, setting.min, setting.max);
    case 'bytes': {
      const bytes = parseBytes(key, text);
      if (bytes < setting.min) throw new ConfigError(`${key}: ${bytes} must be at least ${setting.min}`);
      if (setting.max !== undefined && bytes > setting.max) throw new ConfigError(`${key}: ${bytes} is more than the ${setting.max} bytes it may be at most`);
      return bytes;
    }
    case 'ids':
      return parseIdList(key, text, MAX_ID);
    case 'choice':
      if (!setting.choices.includes(text)) throw new ConfigError(`${key}: "${text}" is not one of ${setting.choices.join(', ')}`);
      return text;
    case 'switch':
      if (!(text in SWITCH_VALUES)) throw new ConfigError(`${key}: "${text}" is not one of ${Object.keys(SWITCH_VALUES).join(', ')}`);
      return SWITCH_VALUES[text];
    case 'text':
      return text;
    case 'group':
      return parseGroup(key, text);
  }
}

/** Every setting's flag and env var, by its config-file key. */
const SETTINGS: Record<SettingKey, SettingDeclaration> = DAEMON_SETTINGS;

export const USAGE = (() => {
  const lines = Object.values(SETTINGS).map((setting) => {
    const left = `  --${setting.flag} ${setting.placeholder}`;
    const shown = shownDefault(setting);
    const help = shown === undefined ? setting.help : `${setting.help} [${shown}]`;
    return `${left.padEnd(34)}${help}\n${' '.repeat(34)}[env ${setting.env}]`;
  });
  return `Usage: vmmd [options]

Serves GPU virtual memory over gRPC on DIR/vmmd.sock, with descriptors passed
on the session socket DIR/vmmd.session.sock. Each option is read from its flag,
else its environment variable, else the JSON file of --config (same names in
camelCase, e.g. {"hostCapacity": "8GiB", "allowUids": [1000]}), else its default.

Options:
  --config FILE                   a JSON file of settings [env VMMD_CONFIG]
${lines.join('\n')}
  -h, --help                      show this help
  -v, --version                   show the version

BYTES takes a plain number or a suffix: K/KiB, M/MiB, G/GiB, T/TiB (powers of
1024) or KB, MB, GB, TB (powers of 1000).`;
})();

export type ParsedCommand = { kind: 'help' } | { kind: 'version' } | { kind: 'run'; config: DaemonConfig };

/** @throws ConfigError naming the offending flag, variable or config file key */
export function parseCommandLine(argv: string[], env: NodeJS.ProcessEnv, pageSize: number): ParsedCommand {
  let values: Record<string, string | boolean | undefined>;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        config: { type: 'string' },
        help: { type: 'boolean', short: 'h' },
        version: { type: 'boolean', short: 'v' },
        ...Object.fromEntries(Object.values(SETTINGS).map((setting) => [setting.flag, { type: 'string' as const }])),
      },
      strict: true,
      allowPositionals: false,
    }));
  } catch (error) {
    throw new ConfigError((error as Error).message);
  }
  if (values.help) return { kind: 'help' };
  if (values.version) return { kind: 'version' };

  const configFile = (values.config as string | undefined) ?? env.VMMD_CONFIG;
  let file: Record<string, unknown> = {};
  if (configFile !== undefined) {
    let text: string;
    try {
      text = fs.readFileSync(configFile, 'utf8');
    } catch (error) {
      throw new ConfigError(`--config: cannot read ${configFile}: ${(error as Error).message}`);
    }
    try {
      file = JSON.parse(text);
    } catch (error) {
      throw new ConfigError(`${configFile}: not JSON: ${(error as Error).message}`);
    }
    if (typeof file !== 'object' || file === null || Array.isArray(file)) throw new ConfigError(`${configFile}: must hold a JSON object`);
    for (const key of Object.keys(file)) {
      if (!(key in SETTINGS)) throw new ConfigError(`${configFile}: unknown key "${key}" (known: ${Object.keys(SETTINGS).join(', ')})`);
    }
  }

  /** The setting's text and where it came from, for messages. */
  const pick = (name: keyof typeof SETTINGS): [string, string | undefined] => {
    const setting = SETTINGS[name];
    const fromFlag = values[setting.flag] as string | undefined;
    if (fromFlag !== undefined) return [`--${setting.flag}`, fromFlag];
    if (env[setting.env] !== undefined) return [setting.env, env[setting.env]];
    if (file[name] !== undefined) {
      const value = file[name];
      const text = Array.isArray(value) ? value.join(',') : String(value);
      return [`${configFile}: ${name}`, text];
    }
    return [name, undefined];
  };

  /** The setting's value: parsed by its declared type within its bounds, else its default. */
  const read = (name: SettingKey) => {
    const [key, text] = pick(name);
    return text === undefined ? SETTINGS[name].default : parseSetting(SETTINGS[name], key, text);
  };
  const integer = (name: SettingKey) => read(name) as number;
  const bytes = (name: SettingKey) => read(name) as bigint;
  const ids = (name: SettingKey) => [...(read(name) as readonly number[])];
  const text = (name: SettingKey) => read(name) as string | undefined;

  const [granularityKey] = pick('hostGranularity');
  const hostGranularity = bytes('hostGranularity');
  if ((hostGranularity & (hostGranularity - 1n)) !== 0n || hostGranularity % BigInt(pageSize) !== 0n) {
    throw new ConfigError(`${granularityKey}: ${hostGranularity} must be a power of two and a multiple of the page size ${pageSize}`);
  }

  const [capacityKey] = pick('hostCapacity');
  const hostCapacity = bytes('hostCapacity') ?? (BigInt(os.totalmem()) / 2n / hostGranularity) * hostGranularity;
  if (hostCapacity < hostGranularity) {
    throw new ConfigError(`${capacityKey}: ${hostCapacity} must be at least the granularity ${hostGranularity}`);
  }

  const [socketKey] = pick('socketDir');
  const socketDir = text('socketDir') ?? defaultSocketDir(env);
  if (socketDir === '') throw new ConfigError(`${socketKey}: the socket directory must not be empty`);

  const [tcpKey] = pick('tcpListen');
  const tcpListen = text('tcpListen') as string;
  const [certKey, cert] = pick('tlsCert');
  const [keyKey, key] = pick('tlsKey');
  const [caKey, ca] = pick('tlsCa');
  let tls: TlsConfig | undefined;
  if (tcpListen !== '') {
    if (!/^[^:]+:\d{1,5}$/.test(tcpListen) && !/^\[[0-9a-fA-F:]+\]:\d{1,5}$/.test(tcpListen)) {
      throw new ConfigError(`${tcpKey}: "${tcpListen}" is not HOST:PORT`);
    }
    if (cert === undefined || key === undefined) {
      throw new ConfigError(`${tcpKey}: the TCP listener is TLS only: set --tls-cert and --tls-key too`);
    }
    for (const [name, path] of [
      [certKey, cert],
      [keyKey, key],
      [caKey, ca],
    ] as const) {
      if (path !== undefined && !fs.existsSync(path)) throw new ConfigError(`${name}: ${path} does not exist`);
    }
    tls = { cert, key, ...(ca === undefined ? {} : { ca }) };
  }

  const [addressKey] = pick('metricsAddress');
  const metricsAddress = text('metricsAddress') as string;
  if (net.isIP(metricsAddress) === 0) throw new ConfigError(`${addressKey}: "${metricsAddress}" is not an IPv4 or IPv6 address`);
  const metricsPort = integer('metricsPort');
  const healthPort = integer('healthPort');
  if (healthPort !== 0 && healthPort === metricsPort) throw new ConfigError(`--health-port: ${healthPort} is the metrics port too; give each its own`);

  const [stockKey] = pick('stock');
  const stock = parseStock(stockKey, text('stock') as string);

  const [takeOverKey] = pick('takeOver');
  if (read('takeOver') === true && text('park') === 'off')
    throw new ConfigError(`${takeOverKey}: a daemon that takes over holds what it takes; --park off holds nothing`);
  if (read('takeOver') === true && read('keeper') === true)
    throw new ConfigError(`${takeOverKey}: the keeper takes over nothing; under it an upgrade is SIGHUP to the keeper`);

  return {
    kind: 'run',
    config: {
      stock,
      backend: text('backend') as BackendChoice,
      socketDir,
      hostCapacity,
      hostGranularity,
      logLevel: text('logLevel') as string,
      socketGroup: read('socketGroup') as number | undefined,
      allowUids: ids('allowUids'),
      allowGids: ids('allowGids'),
      adminUids: ids('adminUids'),
      adminGids: ids('adminGids'),
      maxSessionsPerUid: integer('maxSessionsPerUid'),
      maxTransfersPerUid: integer('maxTransfersPerUid'),
      streamStallMs: integer('streamStallMs'),
      maxServerStreamsPerUid: integer('maxServerStreamsPerUid'),
      maxClientStreamsPerUid: integer('maxClientStreamsPerUid'),
      streamBytesInFlight: bytes('streamBytesInFlight'),
      maxMessageBytes: bytes('maxMessageBytes'),
      maxConnectionsPerUid: integer('maxConnectionsPerUid'),
      maxUnreadDescriptorsPerSession: integer('maxUnreadDescriptorsPerSession'),
      maxUnreadDescriptorsPerUid: integer('maxUnreadDescriptorsPerUid'),
      maxStagingBytesPerUid: bytes('maxStagingBytesPerUid'),
      maxMappingsPerUid: read('maxMappingsPerUid') as number | undefined,
      maxReservationsPerUid: read('maxReservationsPerUid') as number | undefined,
      maxAddressSpacePerUid: read('maxAddressSpacePerUid') as bigint | undefined,
      maxStoresPerUid: read('maxStoresPerUid') as number | undefined,
      maxAllocationsPerUid: read('maxAllocationsPerUid') as number | undefined,
      quotaPerUid: bytes('quotaPerUid'),
      quotaPerSession: bytes('quotaPerSession'),
      transferWaitMs: integer('transferWaitMs'),
      metricsPort,
      metricsAddress,
      healthPort,
      tcpListen,
      tls,
      shutdownGraceMs: integer('shutdownGraceMs'),
      busyPollMicros: integer('busyPollMicros'),
      turnCpu: read('turnCpu') as boolean,
      // A daemon that took over holds what it took: it can be taken over in turn.
      park: read('takeOver') === true && text('park') === 'auto' ? 'held' : (text('park') as 'auto' | 'held' | 'off'),
      takeOver: read('takeOver') as boolean,
      keeper: read('keeper') as boolean,
      parkedGraceMs: integer('parkedGraceMs'),
    },
  };
}
