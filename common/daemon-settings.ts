/**
 * Every setting of the daemon, declared once: its flag, environment variable,
 * type, default, bounds and help. server/app/config.ts parses and prints
 * `--help` from this table, docs/CONFIGURATION.md is generated from it
 * (scripts/gen-declared.js), and the clients take the defaults they share
 * with the daemon (how long a descriptor is waited for) from here. The config
 * file's keys are the table's keys.
 */
import { DEFAULT_BUSY_POLL_MICROS } from './busy-poll';

interface SettingBase {
  flag: string;
  env: string;
  /** The value's shape in `--help`: N, BYTES, LIST… */
  placeholder: string;
  /** One line for `--help`. */
  help: string;
  /** The longer meaning docs/CONFIGURATION.md gives, when it says more than the help. */
  doc?: string;
  /** The default as people read it, where the value alone does not say it ("0: no limit", computed defaults). */
  shown?: string;
}

/** A setting's type, with its default and bounds. */
export type SettingDeclaration = SettingBase &
  (
    | { type: 'integer'; default: number | undefined; min: number; max: number }
    | { type: 'bytes'; default: bigint | undefined; min: bigint; max?: bigint }
    | { type: 'ids'; default: readonly number[] }
    | { type: 'choice'; choices: readonly string[]; default: string }
    | { type: 'switch'; default: boolean }
    | { type: 'text'; default: string | undefined }
    /** A gid, or a group's name in /etc/group. */
    | { type: 'group'; default: number | undefined }
  );

/** The largest count a per-uid budget may be set to. */
export const MAX_BUDGET_COUNT = 100_000_000;

/** The largest address space a uid's budget may name: a 47-bit user address space. */
export const MAX_BUDGET_ADDRESS_SPACE = 1n << 47n;

/** The largest uid or gid (2^32 - 1 is "no id"). */
export const MAX_ID = 2 ** 32 - 2;
export const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;

/** Every setting, by its config-file key, in `--help` order. */
// A table, laid out by hand: each setting's flag, variable, type and default on one row, its help and doc below.
// prettier-ignore
export const DAEMON_SETTINGS = {
  backend: {
    flag: 'backend', env: 'VMMD_BACKEND', placeholder: 'auto|host|cuda', type: 'choice', choices: ['auto', 'host', 'cuda'], default: 'auto',
    help: 'memory backend; auto takes cuda when libcuda.so.1 loads and a device exists',
    doc: '`auto` takes cuda when `libcuda.so.1` loads and a device exists, host otherwise, with one log line saying why; `cuda` without a usable driver stops at start with the reason',
  },
  socketDir: {
    flag: 'socket-dir', env: 'VMMD_SOCKET_DIR', placeholder: 'DIR', type: 'text', default: undefined,
    shown: '/run/vmmd when writable, else $XDG_RUNTIME_DIR/vmmd, else /tmp/vmmd-$UID',
    help: 'directory of vmmd.sock and vmmd.session.sock',
    doc: 'where `vmmd.sock` (gRPC) and `vmmd.session.sock` (sessions) live; a second daemon on the same directory is refused, stale socket files are replaced',
  },
  socketGroup: {
    flag: 'socket-group', env: 'VMMD_SOCKET_GROUP', placeholder: 'GROUP', type: 'group', default: undefined,
    shown: 'none: owner only (0700, 0600)',
    help: 'group (a gid or a name in /etc/group) of the socket directory (0750) and sockets (0660)',
    doc: 'group given the directory (0750) and sockets (0660): a gid or a name in /etc/group (`video`, `vmmd`)',
  },
  allowUids: {
    flag: 'allow-uids', env: 'VMMD_ALLOW_UIDS', placeholder: 'LIST', type: 'ids', default: [], shown: 'all who reach it',
    help: 'comma-separated uids allowed on the session socket (with --allow-gids: either matches)',
    doc: 'peers allowed at all, by uid (with `--allow-gids`, by uid or by a primary or supplementary gid: either matches)',
  },
  allowGids: {
    flag: 'allow-gids', env: 'VMMD_ALLOW_GIDS', placeholder: 'LIST', type: 'ids', default: [], shown: 'all who reach it',
    help: 'comma-separated gids allowed on the session socket: a peer whose primary or supplementary group is one',
  },
  adminUids: {
    flag: 'admin-uids', env: 'VMMD_ADMIN_UIDS', placeholder: 'LIST', type: 'ids', default: [0],
    help: 'comma-separated uids that may act daemon-wide: ClearCaches, GetReport, listing and detaching what other uids hold, calls without a session that change anything',
  },
  adminGids: {
    flag: 'admin-gids', env: 'VMMD_ADMIN_GIDS', placeholder: 'LIST', type: 'ids', default: [], shown: 'none',
    help: 'comma-separated gids that may act daemon-wide, primary or supplementary',
  },
  maxSessionsPerUid: {
    flag: 'max-sessions-per-uid', env: 'VMMD_MAX_SESSIONS_PER_UID', placeholder: 'N', type: 'integer', default: 256, min: 1, max: 1_000_000,
    help: 'sessions one uid may hold open at once',
  },
  maxTransfersPerUid: {
    flag: 'max-transfers-per-uid', env: 'VMMD_MAX_TRANSFERS_PER_UID', placeholder: 'N', type: 'integer', default: 1024, min: 1, max: 1_000_000,
    help: "received descriptors not yet claimed that one uid's sessions may hold at once",
  },
  streamStallMs: {
    flag: 'stream-stall-ms', env: 'VMMD_STREAM_STALL_MS', placeholder: 'MS', type: 'integer', default: 30_000, min: 1, max: 3_600_000,
    help: 'a server stream (Read) whose reader takes nothing this long is ended with RESOURCE_EXHAUSTED',
  },
  maxServerStreamsPerUid: {
    flag: 'max-server-streams-per-uid', env: 'VMMD_MAX_SERVER_STREAMS_PER_UID', placeholder: 'N', type: 'integer', default: 16, min: 1, max: 100_000,
    help: 'server streams (Read, Watch) one uid may have open at once',
  },
  maxClientStreamsPerUid: {
    flag: 'max-client-streams-per-uid', env: 'VMMD_MAX_CLIENT_STREAMS_PER_UID', placeholder: 'N', type: 'integer', default: 8, min: 1, max: 100_000,
    help: 'client streams (Write) one uid may have open at once',
  },
  streamBytesInFlight: {
    flag: 'stream-bytes-in-flight', env: 'VMMD_STREAM_BYTES_IN_FLIGHT', placeholder: 'BYTES', type: 'bytes', default: 256n << 10n, min: 4n << 10n, max: 16n << 20n,
    help: 'bytes a server stream hands the transport before its reader takes them; larger messages are cut to this',
  },
  maxMessageBytes: {
    flag: 'max-message-bytes', env: 'VMMD_MAX_MESSAGE_BYTES', placeholder: 'BYTES', type: 'bytes', default: 2n << 20n, min: (1n << 20n) + (64n << 10n), max: 64n << 20n,
    help: "the largest gRPC message the daemon receives, a Write's chunk included (clients send 1 MiB)",
  },
  maxConnectionsPerUid: {
    flag: 'max-connections-per-uid', env: 'VMMD_MAX_CONNECTIONS_PER_UID', placeholder: 'N', type: 'integer', default: 64, min: 1, max: 1_000_000,
    help: 'gRPC connections one uid may hold open on the Unix socket; more are closed at accept',
  },
  maxUnreadDescriptorsPerSession: {
    flag: 'max-unread-descriptors-per-session', env: 'VMMD_MAX_UNREAD_DESCRIPTORS_PER_SESSION', placeholder: 'N', type: 'integer', default: 512, min: 1, max: 1_000_000,
    help: 'answers carrying a descriptor that a session has not read yet; more requests for one are refused (a burst of concurrent exports or opens stays under it)',
  },
  maxUnreadDescriptorsPerUid: {
    flag: 'max-unread-descriptors-per-uid', env: 'VMMD_MAX_UNREAD_DESCRIPTORS_PER_UID', placeholder: 'N', type: 'integer', default: 4096, min: 1, max: 1_000_000,
    help: "the same for all of one uid's sessions",
  },
  maxStagingBytesPerUid: {
    flag: 'max-staging-bytes-per-uid', env: 'VMMD_MAX_STAGING_BYTES_PER_UID', placeholder: 'BYTES', type: 'bytes', default: 256n << 20n, min: 0n, max: 1n << 40n,
    shown: '256 MiB; 0: no limit',
    help: "bytes of staging buffers one uid's sessions may have the daemon map at once (pages the daemon's staged copies touch are the daemon's memory, in its MemoryMax): room for a few sessions at the clients' 32 MiB, yet many uids together keep the daemon's memory bounded; past it OpenStaging is refused and clients stream over gRPC",
  },
  maxMappingsPerUid: {
    flag: 'max-mappings-per-uid', env: 'VMMD_MAX_MAPPINGS_PER_UID', placeholder: 'N', type: 'integer', default: undefined, min: 0, max: MAX_BUDGET_COUNT,
    shown: "auto: a third of a quarter of vm.max_map_count less the daemon's reserve (an eighth); 0: no limit",
    help: "mappings the daemon holds for one uid at once: Map into its reservations, and each store's own mapping",
  },
  maxReservationsPerUid: {
    flag: 'max-reservations-per-uid', env: 'VMMD_MAX_RESERVATIONS_PER_UID', placeholder: 'N', type: 'integer', default: undefined, min: 0, max: MAX_BUDGET_COUNT,
    shown: 'auto: as --max-mappings-per-uid; 0: no limit',
    help: 'reservations one uid may hold at once',
  },
  maxAddressSpacePerUid: {
    flag: 'max-address-space-per-uid', env: 'VMMD_MAX_ADDRESS_SPACE_PER_UID', placeholder: 'BYTES', type: 'bytes', default: undefined, min: 0n, max: MAX_BUDGET_ADDRESS_SPACE,
    shown: '16TiB: a quarter of the 64 TiB clients may reserve together; 0: no limit',
    help: "bytes of address space one uid's reservations may span at once",
  },
  maxStoresPerUid: {
    flag: 'max-stores-per-uid', env: 'VMMD_MAX_STORES_PER_UID', placeholder: 'N', type: 'integer', default: undefined, min: 0, max: MAX_BUDGET_COUNT,
    shown: "auto: half of a quarter of the descriptor limit less the daemon's reserve (an eighth); 0: no limit",
    help: 'stores one uid may have made and not yet freed',
  },
  maxAllocationsPerUid: {
    flag: 'max-allocations-per-uid', env: 'VMMD_MAX_ALLOCATIONS_PER_UID', placeholder: 'N', type: 'integer', default: undefined, min: 0, max: MAX_BUDGET_COUNT,
    shown: 'auto: as --max-stores-per-uid; 0: no limit',
    help: 'allocations (created and imported) one uid may hold at once, beside their bytes (--quota-per-uid)',
  },
  quotaPerUid: {
    flag: 'quota-per-uid', env: 'VMMD_QUOTA_PER_UID', placeholder: 'BYTES', type: 'bytes', default: 0n, min: 0n, shown: '0: no limit',
    help: 'allocation bytes each uid may hold at once',
    doc: 'physical memory a uid keeps alive through the daemon at once (created, imported, attached; each piece once: [OPERATIONS.md](OPERATIONS.md#quotas-and-capacity))',
  },
  quotaPerSession: {
    flag: 'quota-per-session', env: 'VMMD_QUOTA_PER_SESSION', placeholder: 'BYTES', type: 'bytes', default: 0n, min: 0n, shown: '0: no limit',
    help: 'allocation bytes each session may hold at once',
    doc: 'physical memory a session keeps alive through the daemon at once, counted as for `--quota-per-uid`',
  },
  hostCapacity: {
    flag: 'host-capacity', env: 'VMMD_HOST_CAPACITY', placeholder: 'BYTES', type: 'bytes', default: undefined, min: 0n, shown: "half the machine's RAM",
    help: 'memory the host backend may create in all',
    doc: 'memory the host backend may hold in all (each memfd once, by its size), at least its granularity; past it Create, Import and Attach answer `RESOURCE_EXHAUSTED` with requested, used and limit',
  },
  hostGranularity: {
    flag: 'host-granularity', env: 'VMMD_HOST_GRANULARITY', placeholder: 'BYTES', type: 'bytes', default: 2n << 20n, min: 1n, shown: '2MiB, as CUDA',
    help: 'host backend granularity, a power of two and a page multiple',
    doc: "the host backend's granularity: a power of two, a multiple of the page size",
  },
  transferWaitMs: {
    flag: 'transfer-wait-ms', env: 'VMMD_TRANSFER_WAIT_MS', placeholder: 'MS', type: 'integer', default: 5_000, min: 0, max: 600_000,
    help: 'how long Import and Attach wait for a descriptor',
  },
  metricsPort: {
    flag: 'metrics-port', env: 'VMMD_METRICS_PORT', placeholder: 'PORT', type: 'integer', default: 0, min: 0, max: 65_535, shown: '0: off',
    help: 'serve Prometheus metrics on ADDRESS:PORT/metrics (--metrics-address)',
    doc: 'Prometheus metrics on `ADDRESS:PORT/metrics` ([OPERATIONS.md](OPERATIONS.md#metrics) lists them)',
  },
  metricsAddress: {
    flag: 'metrics-address', env: 'VMMD_METRICS_ADDRESS', placeholder: 'ADDRESS', type: 'text', default: '127.0.0.1',
    help: 'address of the metrics and health ports (an IPv4 or IPv6 address); 0.0.0.0 for scrapers and probes from outside',
    doc: 'where the metrics and health ports listen (an IPv4 or IPv6 address); `0.0.0.0` for scrapers and probes from outside',
  },
  healthPort: {
    flag: 'health-port', env: 'VMMD_HEALTH_PORT', placeholder: 'PORT', type: 'integer', default: 0, min: 0, max: 65_535, shown: '0: off',
    help: 'serve only grpc.health.v1.Health, plaintext, on ADDRESS:PORT (Kubernetes gRPC probes)',
    doc: "`grpc.health.v1.Health` alone, plaintext, on `ADDRESS:PORT`: what Kubernetes' gRPC probes call; not the metrics port",
  },
  tcpListen: {
    flag: 'tcp-listen', env: 'VMMD_TCP_LISTEN', placeholder: 'HOST:PORT', type: 'text', default: '', shown: 'off',
    help: 'also serve gRPC over TCP, TLS only, without sessions or descriptors',
    doc: 'gRPC over TCP, TLS only (`--tls-cert` and `--tls-key`; mutual with `--tls-ca`), no sessions or descriptors',
  },
  tlsCert: {
    flag: 'tls-cert', env: 'VMMD_TLS_CERT', placeholder: 'FILE', type: 'text', default: undefined, shown: 'none',
    help: "the TCP listener's certificate chain (PEM)",
  },
  tlsKey: {
    flag: 'tls-key', env: 'VMMD_TLS_KEY', placeholder: 'FILE', type: 'text', default: undefined, shown: 'none',
    help: "the TCP listener's private key (PEM)",
  },
  tlsCa: {
    flag: 'tls-ca', env: 'VMMD_TLS_CA', placeholder: 'FILE', type: 'text', default: undefined, shown: 'none',
    help: 'require client certificates signed by this CA (mutual TLS)',
  },
  shutdownGraceMs: {
    flag: 'shutdown-grace-ms', env: 'VMMD_SHUTDOWN_GRACE_MS', placeholder: 'MS', type: 'integer', default: 10_000, min: 0, max: 600_000,
    help: 'on SIGTERM, how long calls in flight may finish',
  },
  stock: {
    flag: 'stock', env: 'VMMD_STOCK', placeholder: 'LIST', type: 'text', default: 'auto', shown: 'auto: 2MiB:16,32MiB:2 on cuda, none on host',
    help: "allocations created and exported ahead per device, SIZE:DEPTH,… or none; sizes not a multiple of a device's granularity are skipped",
    doc: 'allocations created and exported ahead per device, `SIZE:DEPTH,…` (depth 1 to 64) or `none`; sizes clients ask often get shelves of their own; frees nobody waits for are held until the daemon is quiet ([OPERATIONS.md](OPERATIONS.md#memory-created-ahead---stock))',
  },
  busyPollMicros: {
    flag: 'busy-poll-us', env: 'VMMD_BUSY_POLL_US', placeholder: 'US', type: 'integer', default: DEFAULT_BUSY_POLL_MICROS, min: 0, max: 10_000,
    shown: `${DEFAULT_BUSY_POLL_MICROS}; 0: off`,
    help: 'before its event loop sleeps, the daemon spins this long for the next message: a round trip with a spinning peer skips two wake-ups (on VMs ~30-70 us each); costs at most that much CPU per wake',
    doc: 'before its event loop sleeps the daemon spins this long for the next message, so that a client\'s request finds it awake; at most that much CPU per wake, none when idle; `0` turns it off ([OPERATIONS.md](OPERATIONS.md#busy-polling---busy-poll-us))',
  },
  park: {
    flag: 'park', env: 'VMMD_PARK', placeholder: 'auto|held|off', type: 'choice', choices: ['auto', 'held', 'off'], default: 'auto',
    help: "keep every allocation's and store's memory and records in the file-descriptor store (systemd's, or vmmd's keeper) so that a restart or a crash loses nothing; auto: wherever NOTIFY_SOCKET names one; held: elsewhere the daemon holds them itself, for a new daemon to take over (--take-over)",
    doc: "`auto` parks every allocation's descriptor, every store and a journal of their records in the service manager's file-descriptor store whenever `NOTIFY_SOCKET` is set (systemd with `FileDescriptorStoreMax=`, or `vmmd --keeper`), and takes them back at start from `LISTEN_FDS`; `held` does the same where `NOTIFY_SOCKET` is set, and elsewhere keeps them in the daemon's own process, where a crash loses them but a new daemon started with `--take-over` takes them over (an upgrade without a keeper); `off` parks nothing ([OPERATIONS.md](OPERATIONS.md#restarts-without-loss))",
  },
  takeOver: {
    flag: 'take-over', env: 'VMMD_TAKE_OVER', placeholder: 'on|off', type: 'switch', default: false, shown: 'off',
    help: 'start by taking over from the daemon serving the same --socket-dir (one started with --park held, or vmmd\'s keeper): every descriptor and session handed over a Unix socket, then the old one exits',
    doc: "starts by taking over from the daemon that serves the same `--socket-dir` (one started with `--park held`, or vmmd's keeper, which stops its daemon first): over `vmmd.handover.sock` (0600, the same uid or root only) the old daemon stops accepting, finishes its calls in flight, hands over every descriptor and its journal, and exits once this one serves; clients resume their sessions by themselves. The new daemon holds what it took (`--park held`) and can be taken over in turn ([OPERATIONS.md](OPERATIONS.md#upgrades-without-a-keeper---take-over))",
  },
  keeper: {
    flag: 'keeper', env: 'VMMD_KEEPER', placeholder: 'on|off', type: 'switch', default: false, shown: 'off',
    help: 'run as the keeper: a small process (no CUDA) that holds the parked descriptors, starts the serving daemon with the same settings, and starts it again after a crash, handing everything back',
    doc: "runs a keeper of vmmd's own in front of the daemon where no systemd does (Docker, Kubernetes, a shell): it answers the file-descriptor store protocol, starts the serving daemon with the same settings and starts it again, with every parked descriptor, when it exits; SIGTERM to the keeper stops both, and the memory goes ([OPERATIONS.md](OPERATIONS.md#restarts-without-loss))",
  },
  parkedGraceMs: {
    flag: 'parked-grace-ms', env: 'VMMD_PARKED_GRACE_MS', placeholder: 'MS', type: 'integer', default: 30_000, min: 0, max: 3_600_000,
    help: "after a restart, how long a parked session waits for its client to resume it (its objects its own meanwhile) before it is reclaimed as if it had closed",
  },
  turnCpu: {
    flag: 'turn-cpu', env: 'VMMD_TURN_CPU', placeholder: 'on|off', type: 'switch', default: true, shown: 'on',
    help: "measure each turn by the event-loop thread's CPU time too, not only by wall clock (on, off; or true, false): two clock system calls a turn, well under 1 us on a GPU host, 1-3 us on a small VM (docs/OPERATIONS.md)",
    doc: "also measures each of the daemon's turns by its event-loop thread's CPU time (GetStats `eventLoopTurnCpu*`, `vmmd_event_loop_turn_cpu_seconds`), not only by wall clock: the difference is time the OS took the thread off its CPU. Two clock system calls a turn; `off` saves them where they are slow (some VMs)",
  },
  logLevel: {
    flag: 'log-level', env: 'VMMD_LOG_LEVEL', placeholder: 'LEVEL', type: 'choice', choices: LOG_LEVELS, default: 'info',
    help: LOG_LEVELS.join('|'),
    doc: `pino JSON lines on stdout: ${LOG_LEVELS.join(', ')}`,
  },
} as const satisfies Record<string, SettingDeclaration>;

export type SettingKey = keyof typeof DAEMON_SETTINGS;

/** A setting's default as `--help` and the docs show it. */
export function shownDefault(setting: SettingDeclaration): string | undefined {
  if (setting.shown !== undefined) return setting.shown;
  if (setting.default === undefined) return undefined;
  if (setting.type === 'ids') return setting.default.join(',');
  if (setting.type === 'switch') return setting.default ? 'on' : 'off';
  return String(setting.default);
}

/** How long the daemon waits for a descriptor sent as a transfer; the clients wait as long for theirs. */
export const DEFAULT_TRANSFER_WAIT_MS = DAEMON_SETTINGS.transferWaitMs.default;
/** Sessions one uid may hold open at once, unless --max-sessions-per-uid says otherwise. */
export const DEFAULT_MAX_SESSIONS_PER_UID = DAEMON_SETTINGS.maxSessionsPerUid.default;
