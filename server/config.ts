/**
 * The daemon's configuration from flags and environment. Invalid values fail
 * at start with the flag named.
 */
import * as os from 'node:os';
import { parseArgs } from 'node:util';
import { defaultSocketDir } from '../common/paths';

export type BackendChoice = 'auto' | 'host' | 'cuda';

export interface DaemonConfig {
  backend: BackendChoice;
  socketDir: string;
  hostCapacity: bigint;
  hostGranularity: bigint;
  logLevel: string;
}

export const USAGE = `Usage: vmmd [options]

Serves GPU virtual memory over gRPC on DIR/vmmd.sock, with descriptors passed
on the session socket DIR/vmmd.session.sock.

Options (each also read from the environment variable shown):
  --backend auto|host|cuda   memory backend; auto takes cuda when libcuda.so.1
                             loads and a device exists, host otherwise
                             [VMMD_BACKEND, default auto]
  --socket-dir DIR           directory of the two sockets [VMMD_SOCKET_DIR,
                             default /run/vmmd when writable, else
                             $XDG_RUNTIME_DIR/vmmd, else /tmp/vmmd-$UID]
  --host-capacity BYTES      memory the host backend may create in all
                             [VMMD_HOST_CAPACITY, default half the machine's RAM]
  --host-granularity BYTES   host backend granularity, a power of two and a
                             multiple of the page size [VMMD_HOST_GRANULARITY,
                             default 2MiB, as CUDA's]
  --log-level LEVEL          trace|debug|info|warn|error|fatal|silent
                             [VMMD_LOG_LEVEL, default info]
  -h, --help                 show this help
  -v, --version              show the version

BYTES takes a plain number or a suffix: K/KiB, M/MiB, G/GiB, T/TiB (powers of
1024) or KB, MB, GB, TB (powers of 1000).`;

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

const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'];

export type ParsedCommand = { kind: 'help' } | { kind: 'version' } | { kind: 'run'; config: DaemonConfig };

/** @throws ConfigError naming the offending flag or variable */
export function parseCommandLine(argv: string[], env: NodeJS.ProcessEnv, pageSize: number): ParsedCommand {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        backend: { type: 'string' },
        'socket-dir': { type: 'string' },
        'host-capacity': { type: 'string' },
        'host-granularity': { type: 'string' },
        'log-level': { type: 'string' },
        help: { type: 'boolean', short: 'h' },
        version: { type: 'boolean', short: 'v' },
      },
      strict: true,
      allowPositionals: false,
    }));
  } catch (error) {
    throw new ConfigError((error as Error).message);
  }
  if (values.help) return { kind: 'help' };
  if (values.version) return { kind: 'version' };

  const pick = (flag: string, variable: string): [string, string | undefined] => {
    const fromFlag = (values as Record<string, string | undefined>)[flag];
    return fromFlag !== undefined ? [`--${flag}`, fromFlag] : [variable, env[variable]];
  };

  const [backendKey, backend = 'auto'] = pick('backend', 'VMMD_BACKEND');
  if (backend !== 'auto' && backend !== 'host' && backend !== 'cuda') {
    throw new ConfigError(`${backendKey}: "${backend}" is not one of auto, host, cuda`);
  }

  const [granularityKey, granularityText] = pick('host-granularity', 'VMMD_HOST_GRANULARITY');
  const hostGranularity = granularityText === undefined ? 2n << 20n : parseBytes(granularityKey, granularityText);
  if (hostGranularity <= 0n || (hostGranularity & (hostGranularity - 1n)) !== 0n || hostGranularity % BigInt(pageSize) !== 0n) {
    throw new ConfigError(`${granularityKey}: ${hostGranularity} must be a power of two and a multiple of the page size ${pageSize}`);
  }

  const [capacityKey, capacityText] = pick('host-capacity', 'VMMD_HOST_CAPACITY');
  const defaultCapacity = (BigInt(os.totalmem()) / 2n / hostGranularity) * hostGranularity;
  const hostCapacity = capacityText === undefined ? defaultCapacity : parseBytes(capacityKey, capacityText);
  if (hostCapacity < hostGranularity) {
    throw new ConfigError(`${capacityKey}: ${hostCapacity} must be at least the granularity ${hostGranularity}`);
  }

  const [logKey, logLevel = 'info'] = pick('log-level', 'VMMD_LOG_LEVEL');
  if (!LOG_LEVELS.includes(logLevel)) throw new ConfigError(`${logKey}: "${logLevel}" is not one of ${LOG_LEVELS.join(', ')}`);

  const [socketKey, socketDir = defaultSocketDir(env)] = pick('socket-dir', 'VMMD_SOCKET_DIR');
  if (socketDir === '') throw new ConfigError(`${socketKey}: the socket directory must not be empty`);

  return { kind: 'run', config: { backend, socketDir, hostCapacity, hostGranularity, logLevel } };
}
