/**
 * The daemon's configuration: one table of settings, each read from a flag,
 * else its environment variable, else the JSON config file (--config), else
 * its default. Invalid values fail at start with the key named. `--help` is
 * generated from the same table.
 */
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import { parseArgs } from 'node:util';
import { defaultSocketDir } from '../../common/paths';
import { DEFAULT_BUSY_POLL_MICROS } from '../../common/busy-poll';

export type BackendChoice = 'auto' | 'host' | 'cuda';

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
}

export interface StockLevel {
  size: bigint;
  depth: number;
}

/** What --stock auto means: on cuda, a few of the sizes cold allocations ask for most (the client's 2 MiB granule and 32 MiB pool chunk); none on host, where creating is a memfd. */
export function defaultStock(backend: 'host' | 'cuda'): StockLevel[] {
  return backend === 'cuda'
    ? [
        { size: 2n << 20n, depth: 16 },
        { size: 32n << 20n, depth: 2 },
      ]
    : [];
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

function parseIdList(key: string, text: string): number[] {
  if (text.trim() === '') return [];
  return text.split(',').map((part) => parseInteger(key, part, 0, 2 ** 32 - 2));
}

/** A gid, or a group name looked up in /etc/group (what users type: video, vmmd). @throws ConfigError naming the key */
function parseGroup(key: string, text: string): number {
  if (/^\s*\d+\s*$/.test(text)) return parseInteger(key, text, 0, 2 ** 32 - 2);
  let groups = '';
  try {
    groups = fs.readFileSync('/etc/group', 'utf8');
  } catch {
    // no /etc/group: no names to resolve
  }
  const entry = groups.split('\n').map((line) => line.split(':')).find((fields) => fields[0] === text.trim() && fields.length >= 3);
  if (entry === undefined) throw new ConfigError(`${key}: "${text}" is neither a gid nor a group in /etc/group`);
  return Number(entry[2]);
}

const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'];

interface Setting {
  flag: string;
  env: string;
  help: string;
  placeholder: string;
}

/** Every setting: the config file uses the camelCase names. */
const SETTINGS: Record<string, Setting> = {
  backend: { flag: 'backend', env: 'VMMD_BACKEND', placeholder: 'auto|host|cuda', help: 'memory backend; auto takes cuda when libcuda.so.1 loads and a device exists [auto]' },
  socketDir: { flag: 'socket-dir', env: 'VMMD_SOCKET_DIR', placeholder: 'DIR', help: 'directory of vmmd.sock and vmmd.session.sock [/run/vmmd when writable, else $XDG_RUNTIME_DIR/vmmd, else /tmp/vmmd-$UID]' },
  socketGroup: { flag: 'socket-group', env: 'VMMD_SOCKET_GROUP', placeholder: 'GROUP', help: 'group (a gid or a name in /etc/group) of the socket directory (0750) and sockets (0660); unset: owner only (0700, 0600)' },
  allowUids: { flag: 'allow-uids', env: 'VMMD_ALLOW_UIDS', placeholder: 'LIST', help: 'comma-separated uids allowed on the session socket (with --allow-gids: either matches) [all who reach it]' },
  allowGids: { flag: 'allow-gids', env: 'VMMD_ALLOW_GIDS', placeholder: 'LIST', help: 'comma-separated gids allowed on the session socket: a peer whose primary or supplementary group is one' },
  adminUids: { flag: 'admin-uids', env: 'VMMD_ADMIN_UIDS', placeholder: 'LIST', help: 'comma-separated uids that may act daemon-wide: ClearCaches, GetReport, listing and detaching what other uids hold, calls without a session that change anything [0]' },
  adminGids: { flag: 'admin-gids', env: 'VMMD_ADMIN_GIDS', placeholder: 'LIST', help: 'comma-separated gids that may act daemon-wide, primary or supplementary [none]' },
  maxSessionsPerUid: { flag: 'max-sessions-per-uid', env: 'VMMD_MAX_SESSIONS_PER_UID', placeholder: 'N', help: 'sessions one uid may hold open at once [256]' },
  maxTransfersPerUid: { flag: 'max-transfers-per-uid', env: 'VMMD_MAX_TRANSFERS_PER_UID', placeholder: 'N', help: "received descriptors not yet claimed that one uid's sessions may hold at once [1024]" },
  streamStallMs: { flag: 'stream-stall-ms', env: 'VMMD_STREAM_STALL_MS', placeholder: 'MS', help: 'a server stream (Read) whose reader takes nothing this long is ended with RESOURCE_EXHAUSTED [30000]' },
  quotaPerUid: { flag: 'quota-per-uid', env: 'VMMD_QUOTA_PER_UID', placeholder: 'BYTES', help: 'allocation bytes each uid may hold at once [0: no limit]' },
  quotaPerSession: { flag: 'quota-per-session', env: 'VMMD_QUOTA_PER_SESSION', placeholder: 'BYTES', help: 'allocation bytes each session may hold at once [0: no limit]' },
  hostCapacity: { flag: 'host-capacity', env: 'VMMD_HOST_CAPACITY', placeholder: 'BYTES', help: "memory the host backend may create in all [half the machine's RAM]" },
  hostGranularity: { flag: 'host-granularity', env: 'VMMD_HOST_GRANULARITY', placeholder: 'BYTES', help: 'host backend granularity, a power of two and a page multiple [2MiB, as CUDA]' },
  transferWaitMs: { flag: 'transfer-wait-ms', env: 'VMMD_TRANSFER_WAIT_MS', placeholder: 'MS', help: 'how long Import and Attach wait for a descriptor [5000]' },
  metricsPort: { flag: 'metrics-port', env: 'VMMD_METRICS_PORT', placeholder: 'PORT', help: 'serve Prometheus metrics on ADDRESS:PORT/metrics (--metrics-address) [0: off]' },
  metricsAddress: { flag: 'metrics-address', env: 'VMMD_METRICS_ADDRESS', placeholder: 'ADDRESS', help: 'address of the metrics and health ports; 0.0.0.0 for scrapers and probes from outside [127.0.0.1]' },
  healthPort: { flag: 'health-port', env: 'VMMD_HEALTH_PORT', placeholder: 'PORT', help: 'serve only grpc.health.v1.Health, plaintext, on ADDRESS:PORT (Kubernetes gRPC probes) [0: off]' },
  tcpListen: { flag: 'tcp-listen', env: 'VMMD_TCP_LISTEN', placeholder: 'HOST:PORT', help: 'also serve gRPC over TCP, TLS only, without sessions or descriptors [off]' },
  tlsCert: { flag: 'tls-cert', env: 'VMMD_TLS_CERT', placeholder: 'FILE', help: "the TCP listener's certificate chain (PEM)" },
  tlsKey: { flag: 'tls-key', env: 'VMMD_TLS_KEY', placeholder: 'FILE', help: "the TCP listener's private key (PEM)" },
  tlsCa: { flag: 'tls-ca', env: 'VMMD_TLS_CA', placeholder: 'FILE', help: 'require client certificates signed by this CA (mutual TLS)' },
  shutdownGraceMs: { flag: 'shutdown-grace-ms', env: 'VMMD_SHUTDOWN_GRACE_MS', placeholder: 'MS', help: 'on SIGTERM, how long calls in flight may finish [10000]' },
  stock: { flag: 'stock', env: 'VMMD_STOCK', placeholder: 'LIST', help: 'allocations created and exported ahead per device, SIZE:DEPTH,… or none; sizes not a multiple of a device\'s granularity are skipped [auto: 2MiB:16,32MiB:2 on cuda, none on host]' },
  busyPollMicros: { flag: 'busy-poll-us', env: 'VMMD_BUSY_POLL_US', placeholder: 'US', help: 'before its event loop sleeps, the daemon spins this long for the next message: a round trip with a spinning peer skips two wake-ups (on VMs ~30-70 us each); costs at most that much CPU per wake [200; 0: off]' },
  turnCpu: { flag: 'turn-cpu', env: 'VMMD_TURN_CPU', placeholder: 'on|off', help: "measure each turn by the event-loop thread's CPU time too, not only by wall clock (on, off; or true, false): two clock system calls a turn, well under 1 us on a GPU host, 1-3 us on a small VM (docs/OPERATIONS.md) [on]" },
  logLevel: { flag: 'log-level', env: 'VMMD_LOG_LEVEL', placeholder: 'LEVEL', help: `${LOG_LEVELS.join('|')} [info]` },
};

export const USAGE = (() => {
  const lines = Object.values(SETTINGS).map((setting) => {
    const left = `  --${setting.flag} ${setting.placeholder}`;
    return `${left.padEnd(34)}${setting.help}\n${' '.repeat(34)}[env ${setting.env}]`;
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

  const [backendKey, backend = 'auto'] = pick('backend');
  if (backend !== 'auto' && backend !== 'host' && backend !== 'cuda') {
    throw new ConfigError(`${backendKey}: "${backend}" is not one of auto, host, cuda`);
  }

  const [granularityKey, granularityText] = pick('hostGranularity');
  const hostGranularity = granularityText === undefined ? 2n << 20n : parseBytes(granularityKey, granularityText);
  if (hostGranularity <= 0n || (hostGranularity & (hostGranularity - 1n)) !== 0n || hostGranularity % BigInt(pageSize) !== 0n) {
    throw new ConfigError(`${granularityKey}: ${hostGranularity} must be a power of two and a multiple of the page size ${pageSize}`);
  }

  const [capacityKey, capacityText] = pick('hostCapacity');
  const defaultCapacity = (BigInt(os.totalmem()) / 2n / hostGranularity) * hostGranularity;
  const hostCapacity = capacityText === undefined ? defaultCapacity : parseBytes(capacityKey, capacityText);
  if (hostCapacity < hostGranularity) {
    throw new ConfigError(`${capacityKey}: ${hostCapacity} must be at least the granularity ${hostGranularity}`);
  }

  const [logKey, logLevel = 'info'] = pick('logLevel');
  if (!LOG_LEVELS.includes(logLevel)) throw new ConfigError(`${logKey}: "${logLevel}" is not one of ${LOG_LEVELS.join(', ')}`);

  const [socketKey, socketDir = defaultSocketDir(env)] = pick('socketDir');
  if (socketDir === '') throw new ConfigError(`${socketKey}: the socket directory must not be empty`);

  const [groupKey, groupText] = pick('socketGroup');
  const socketGroup = groupText === undefined ? undefined : parseGroup(groupKey, groupText);

  const [uidsKey, uidsText = ''] = pick('allowUids');
  const [gidsKey, gidsText = ''] = pick('allowGids');

  const bytesOr0 = (name: 'quotaPerUid' | 'quotaPerSession') => {
    const [key, text] = pick(name);
    return text === undefined ? 0n : parseBytes(key, text);
  };
  const integer = (
    name: 'transferWaitMs' | 'metricsPort' | 'healthPort' | 'shutdownGraceMs' | 'maxSessionsPerUid' | 'maxTransfersPerUid' | 'streamStallMs' | 'busyPollMicros',
    fallback: number,
    max: number,
    min = 0,
  ) => {
    const [key, text] = pick(name);
    return text === undefined ? fallback : parseInteger(key, text, min, max);
  };
  const [adminUidsKey, adminUidsText = '0'] = pick('adminUids');
  const [adminGidsKey, adminGidsText = ''] = pick('adminGids');

  const [tcpKey, tcpListen = ''] = pick('tcpListen');
  const [certKey, cert] = pick('tlsCert');
  const [keyKey, key] = pick('tlsKey');
  const [, ca] = pick('tlsCa');
  let tls: TlsConfig | undefined;
  if (tcpListen !== '') {
    if (!/^[^:]+:\d{1,5}$/.test(tcpListen) && !/^\[[0-9a-fA-F:]+\]:\d{1,5}$/.test(tcpListen)) {
      throw new ConfigError(`${tcpKey}: "${tcpListen}" is not HOST:PORT`);
    }
    if (cert === undefined || key === undefined) {
      throw new ConfigError(`${tcpKey}: the TCP listener is TLS only: set --tls-cert and --tls-key too`);
    }
    for (const [name, path] of [[certKey, cert], [keyKey, key], ['--tls-ca', ca]] as const) {
      if (path !== undefined && !fs.existsSync(path)) throw new ConfigError(`${name}: ${path} does not exist`);
    }
    tls = { cert, key, ...(ca === undefined ? {} : { ca }) };
  }

  const [addressKey, metricsAddress = '127.0.0.1'] = pick('metricsAddress');
  if (net.isIP(metricsAddress) === 0) throw new ConfigError(`${addressKey}: "${metricsAddress}" is not an IPv4 or IPv6 address`);
  const metricsPort = integer('metricsPort', 0, 65_535);
  const healthPort = integer('healthPort', 0, 65_535);
  if (healthPort !== 0 && healthPort === metricsPort) throw new ConfigError(`--health-port: ${healthPort} is the metrics port too; give each its own`);

  const [turnCpuKey, turnCpuText = 'on'] = pick('turnCpu');
  if (!['on', 'off', 'true', 'false'].includes(turnCpuText)) throw new ConfigError(`${turnCpuKey}: "${turnCpuText}" is not one of on, off, true, false`);

  const [stockKey, stockText = 'auto'] = pick('stock');
  const stock = parseStock(stockKey, stockText);

  return {
    kind: 'run',
    config: {
      stock,
      backend,
      socketDir,
      hostCapacity,
      hostGranularity,
      logLevel,
      socketGroup,
      allowUids: parseIdList(uidsKey, uidsText),
      allowGids: parseIdList(gidsKey, gidsText),
      adminUids: parseIdList(adminUidsKey, adminUidsText),
      adminGids: parseIdList(adminGidsKey, adminGidsText),
      maxSessionsPerUid: integer('maxSessionsPerUid', 256, 1_000_000, 1),
      maxTransfersPerUid: integer('maxTransfersPerUid', 1024, 1_000_000, 1),
      streamStallMs: integer('streamStallMs', 30_000, 3_600_000, 1),
      quotaPerUid: bytesOr0('quotaPerUid'),
      quotaPerSession: bytesOr0('quotaPerSession'),
      transferWaitMs: integer('transferWaitMs', 5_000, 600_000),
      metricsPort,
      metricsAddress,
      healthPort,
      tcpListen,
      tls,
      shutdownGraceMs: integer('shutdownGraceMs', 10_000, 600_000),
      busyPollMicros: integer('busyPollMicros', DEFAULT_BUSY_POLL_MICROS, 10_000),
      turnCpu: turnCpuText === 'on' || turnCpuText === 'true',
    },
  };
}
