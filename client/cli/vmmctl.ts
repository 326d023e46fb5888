/**
 * vmmctl: the operator's command line for a running vmmd. The command line is
 * checked whole before the daemon is asked anything; sizes are human (KiB,
 * MiB, …) unless --bytes; --json prints what every command answers as JSON
 * (sizes in bytes there, as decimal strings like the API's uint64 fields).
 */
import { status as Status } from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { parseArgs } from 'node:util';
import { connect, VmmdClient } from '../connection';
import { VmmdError } from '../errors';
import type { StoreName } from '../stores';
import { copyFileToMemory, copyMemoryToWriter } from '../pinned-copy';
import { defaultSocketDir } from '../../common/paths';
import { checkHealth } from './health';
import { inspect, VmmdInspector } from '../inspect';
import { CHUNK, humanBytes, openSource, PartialFile, Progress } from './files';

export { humanBytes };

export const USAGE = `Usage: vmmctl [--socket-dir DIR] [--json] [--bytes] COMMAND
  devices                       the daemon's devices
  stats                         objects, bytes and sessions the daemon holds
  sessions                      open sessions: pid, command, cgroup, uid, gid and what they hold
  objects [SESSION]             reservations, allocations, mappings, stores (of one session, by id)
  report                        everything, as JSON
  clear-caches                  close descriptors sent and never claimed
  version                       the daemon's version, build and runtime
  health                        the daemon's health service, without a session: exit 0 when SERVING
  store load NAME FILE          fill a new read-only store from FILE, - for standard input
                                (--mutable: writable; --host: host memory on cuda)
  store dump STORE FILE         write the store's bytes to FILE, - for standard output
  store ls                      list stores
  store rm STORE                detach the store: no new opens, freed when the last reader closes
STORE is a store's name or its id (digits, as store ls shows); a new store's name may not be digits only.
Options: --json (machine-readable), --bytes (sizes in bytes), --version (this vmmctl's), --help`;

/** This package's version: from the nearest package.json above (dist/client/cli/ or client/cli/). */
const VERSION: string = (() => {
  for (let dir = __dirname; ; dir = path.dirname(dir)) {
    const file = path.join(dir, 'package.json');
    if (fs.existsSync(file)) return JSON.parse(fs.readFileSync(file, 'utf8')).version as string;
    if (path.dirname(dir) === dir) return 'unknown';
  }
})();

class UsageError extends Error {}

/** What the command line asks for, checked before anything is sent. */
type Command =
  | { kind: 'devices' | 'stats' | 'sessions' | 'report' | 'clear-caches' | 'version' | 'health' | 'store-ls' }
  | { kind: 'objects'; session?: bigint }
  | { kind: 'store-load'; name: string; file: string }
  | { kind: 'store-dump'; store: StoreName; file: string }
  | { kind: 'store-rm'; store: StoreName };

/** Commands that only look: they run without a session (server/transport/grpc/access.ts lets any allowed caller inspect). */
const INSPECTIONS = new Set<Command['kind']>(['devices', 'stats', 'sessions', 'objects', 'report', 'version', 'store-ls']);

/** A store argument: digits are an id, anything else a name. */
function storeArgument(text: string): StoreName {
  return /^\d+$/.test(text) ? BigInt(text) : text;
}

function parseCommand(positionals: string[]): Command {
  const [command, sub, ...rest] = positionals;
  const arity = (count: number, synopsis: string) => {
    if (rest.length !== count) throw new UsageError(`"${['store', sub].join(' ')}" takes ${synopsis}`);
  };
  switch (command) {
    case 'devices':
    case 'stats':
    case 'sessions':
    case 'report':
    case 'clear-caches':
    case 'version':
    case 'health':
      if (positionals.length !== 1) throw new UsageError(`"${command}" takes no arguments`);
      return { kind: command };
    case 'objects':
      if (positionals.length > 2) throw new UsageError('"objects" takes at most one session id');
      if (sub === undefined) return { kind: 'objects' };
      if (!/^[1-9]\d*$/.test(sub)) throw new UsageError(`"${sub}" is not a session id: ids are positive whole numbers (vmmctl sessions lists them)`);
      return { kind: 'objects', session: BigInt(sub) };
    case 'store':
      switch (sub) {
        case 'load':
          arity(2, 'NAME FILE');
          if (/^\d+$/.test(rest[0])) throw new UsageError(`"${rest[0]}" cannot name a store: a name of digits only would read as a store id`);
          if (rest[0] === '') throw new UsageError('a store loaded by vmmctl needs a name');
          return { kind: 'store-load', name: rest[0], file: rest[1] };
        case 'dump':
          arity(2, 'STORE FILE');
          return { kind: 'store-dump', store: storeArgument(rest[0]), file: rest[1] };
        case 'ls':
          arity(0, 'no arguments');
          return { kind: 'store-ls' };
        case 'rm':
          arity(1, 'STORE');
          return { kind: 'store-rm', store: storeArgument(rest[0]) };
        default:
          throw new UsageError(sub === undefined ? '"store" needs a subcommand: load, dump, ls or rm' : `unknown command "store ${sub}"`);
      }
    default:
      throw new UsageError(`unknown command "${command}"`);
  }
}

interface Result {
  /** The line printed without --json. */
  text: string;
  /** What --json prints. */
  json: unknown;
}

async function load(client: VmmdClient, name: string, file: string, options: { mutable: boolean; host: boolean }): Promise<Result> {
  // The name first: a taken name is refused before a byte moves.
  const taken = (await client.stores.list()).find((store) => store.name === name && store.state !== 'STORE_STATE_DETACHED');
  if (taken !== undefined)
    throw new VmmdError('NAME_TAKEN', Status.ALREADY_EXISTS, `a store named ${JSON.stringify(name)} exists (store ${taken.id}); vmmctl store rm ${name} first`);
  // From here: a pipe is read whole before the upload, and its reading is part of the load's time.
  const started = performance.now();
  const source = openSource(file);
  const shown = file === '-' ? 'standard input' : file;
  try {
    if (source.size === 0) throw new VmmdError('ZERO_SIZE', Status.INVALID_ARGUMENT, `${shown} is empty: a store holds at least one byte`);
    const location =
      options.host && client.session.capabilities.has('CAPABILITY_HOST_NUMA')
        ? { type: 'LOCATION_TYPE_HOST_NUMA' as const, id: 0 }
        : { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 };
    const granularity = BigInt((await client.devices.getGranularity({ location })).minimum);
    const allocationSize = ((BigInt(source.size) + granularity - 1n) / granularity) * granularity;
    const allocation = await client.vmm.create({ size: allocationSize, location });
    try {
      const memory = await client.vmm.import(allocation.id);
      const progress = new Progress(`load ${name}`, source.size, started);
      try {
        if (client.backend === 'cuda' && source.regular !== undefined) {
          // Page-locked buffers, several chunks in flight: file reads overlap the copy engine instead of waiting for it.
          await copyFileToMemory(memory, source.regular.fd, source.size, shown, (done) => progress.update(done));
        } else {
          let done = 0;
          for (const chunk of source.chunks(Buffer.allocUnsafe(CHUNK))) {
            await memory.write(done, chunk);
            done += chunk.length;
            progress.update(done);
          }
        }
      } finally {
        await memory.close();
      }
      // The store holds its own reference and belongs to the daemon: it outlives this command.
      const store = await client.stores.createStore({
        allocationId: allocation.id,
        name,
        readOnly: !options.mutable,
        handOver: true,
        size: BigInt(source.size),
      });
      const { seconds, line } = progress.finish('loaded');
      return {
        text: `${line} into store ${store.id} "${name}"${options.mutable ? '' : ', read-only'}`,
        json: { loaded: String(source.size), seconds, store },
      };
    } finally {
      // The store (if made) holds its own reference; on a failure this frees the memory.
      await client.vmm.release({ allocationId: allocation.id });
    }
  } finally {
    source.close();
  }
}

async function dump(client: VmmdClient, store: StoreName, file: string): Promise<Result> {
  const opened = await client.stores.open(store, { writable: false });
  try {
    const size = Number(opened.store.size);
    const progress = new Progress(`dump ${opened.store.name || opened.store.id}`, size);
    const partial = file === '-' ? undefined : new PartialFile(file);
    const fd = partial === undefined ? 1 : partial.fd;
    const write = async (bytes: Buffer) => {
      for (let written = 0; written < bytes.length;) {
        try {
          written += fs.writeSync(fd, bytes, written);
        } catch (error) {
          // Standard output may be a non-blocking pipe: wait for the reader.
          if ((error as NodeJS.ErrnoException).code !== 'EAGAIN') throw error;
          await new Promise((resolve) => setTimeout(resolve, 1));
        }
      }
    };
    try {
      if (client.backend === 'cuda') {
        // Page-locked buffers: device copies of later chunks run while earlier ones are written, not one after the other.
        await copyMemoryToWriter(opened.memory, size, write, (done) => progress.update(done));
      } else {
        for (let done = 0; done < size;) {
          const length = Math.min(CHUNK, size - done);
          await write(await opened.memory.read(done, length));
          done += length;
          progress.update(done);
          // Host memory reads at once (a resolved promise): a turn of the event loop lets a Ctrl-C in.
          await new Promise((resolve) => setImmediate(resolve));
        }
      }
      partial?.finish();
    } finally {
      partial?.abandon();
    }
    const { seconds, line } = progress.finish('dumped');
    return {
      text: `${line} from store ${opened.store.id}${opened.store.name ? ` "${opened.store.name}"` : ''} to ${file === '-' ? 'standard output' : file}`,
      json: { dumped: String(size), seconds, store: opened.store },
    };
  } finally {
    await opened.close();
  }
}

function table(rows: Array<Record<string, unknown>>): string {
  if (rows.length === 0) return '(none)';
  const columns = Object.keys(rows[0]);
  const widths = columns.map((column) => Math.max(column.length, ...rows.map((row) => String(row[column]).length)));
  const line = (values: string[]) =>
    values
      .map((value, i) => value.padEnd(widths[i]))
      .join('  ')
      .trimEnd();
  return [line(columns), ...rows.map((row) => line(columns.map((column) => String(row[column]))))].join('\n');
}

/** One object as "key  value" lines: for single records too wide for a row. */
function fields(record: Record<string, unknown>): string {
  const width = Math.max(...Object.keys(record).map((key) => key.length));
  return Object.entries(record)
    .map(([key, value]) => `${key.padEnd(width)}  ${value}`)
    .join('\n');
}

export async function main(argv: string[]): Promise<number> {
  let values;
  let command: Command;
  try {
    const parsed = parseArgs({
      args: argv,
      options: {
        'socket-dir': { type: 'string' },
        json: { type: 'boolean' },
        bytes: { type: 'boolean' },
        mutable: { type: 'boolean' },
        host: { type: 'boolean' },
        help: { type: 'boolean', short: 'h' },
        version: { type: 'boolean', short: 'V' },
      },
      allowPositionals: true,
    });
    values = parsed.values;
    if (values.help) {
      process.stdout.write(`${USAGE}\n`);
      return 0;
    }
    if (values.version) {
      process.stdout.write(values.json ? `${JSON.stringify({ vmmctl: VERSION })}\n` : `vmmctl ${VERSION}\n`);
      return 0;
    }
    if (parsed.positionals.length === 0) throw new UsageError('no command');
    command = parseCommand(parsed.positionals);
    if ((values.mutable || values.host) && command.kind !== 'store-load') throw new UsageError('--mutable and --host go with "store load" only');
  } catch (error) {
    // parseArgs' own errors (unknown options) are usage errors too.
    process.stderr.write(`vmmctl: ${(error as Error).message}\n${USAGE}\n`);
    return 2;
  }
  const json = values.json ?? false;
  const size = (bytes: string | number | bigint) => (values.bytes ? String(bytes) : humanBytes(bytes));
  const out = (result: Result) => process.stdout.write(`${json ? JSON.stringify(result.json, null, 2) : result.text}\n`);
  const rows = (records: Array<Record<string, unknown>>, raw: unknown) => out({ text: table(records), json: raw });
  if (command.kind === 'health') {
    const health = await checkHealth(values['socket-dir'] ?? defaultSocketDir());
    process.stdout.write(json ? `${JSON.stringify(health)}\n` : `${health.status}\n`);
    return health.serving ? 0 : 1;
  }
  let client: VmmdClient | undefined;
  let inspector: VmmdInspector | undefined;
  try {
    // Listings go without a session: nothing opened in the daemon, nothing logged there (a health check's vmmctl runs every 30 s).
    const view = INSPECTIONS.has(command.kind)
      ? (inspector = await inspect({ socketDir: values['socket-dir'] }))
      : (client = await connect({ socketDir: values['socket-dir'] }));
    switch (command.kind) {
      case 'devices': {
        const { devices } = await view.devices.listDevices();
        rows(
          devices.map((d) => ({
            index: d.index,
            name: d.name,
            uuid: d.uuid,
            total: size(d.totalBytes),
            free: size(d.freeBytes),
            granularity: size(d.granularityMinimum),
          })),
          devices,
        );
        break;
      }
      case 'stats': {
        const stats = await view.admin.getStats();
        const shown = Object.fromEntries(Object.entries(stats).map(([key, value]) => [key, /Bytes$/.test(key) ? size(value as string) : value]));
        out({ text: fields(shown), json: stats });
        break;
      }
      case 'sessions': {
        const { sessions } = await view.admin.listSessions();
        rows(
          sessions.map((s) => ({
            id: s.id,
            pid: s.pid,
            command: s.command,
            uid: s.uid,
            gid: s.gid,
            allocations: s.allocations,
            allocated: size(s.allocatedBytes),
            reservations: s.reservations,
            calls: s.callsInFlight,
            pending: s.pendingTransfers,
            closing: s.closing,
            cgroup: s.cgroup,
          })),
          sessions,
        );
        break;
      }
      case 'objects': {
        if (command.session !== undefined) {
          const { sessions } = await view.admin.listSessions();
          if (!sessions.some((s) => BigInt(s.id) === command.session)) {
            throw new VmmdError('UNKNOWN_SESSION', Status.NOT_FOUND, `no open session has id ${command.session} (vmmctl sessions lists them)`);
          }
        }
        const { objects } = await view.admin.listObjects({ ownerSession: command.session ?? 0n });
        rows(
          objects.map((o) => ({ ...o, size: size(o.size), address: o.address === '0' ? '' : `0x${BigInt(o.address).toString(16)}` })),
          objects,
        );
        break;
      }
      case 'report':
        process.stdout.write(`${JSON.stringify(await view.admin.getReport(), null, 2)}\n`);
        break;
      case 'clear-caches': {
        const cleared = await client!.admin.clearCaches();
        out({ text: `closed ${cleared.transfersClosed} unclaimed descriptor(s)`, json: cleared });
        break;
      }
      case 'version': {
        const version = await view.admin.getVersion();
        out({ text: fields({ vmmctl: VERSION, ...version }), json: { vmmctl: VERSION, ...version } });
        break;
      }
      case 'store-load': {
        const result = await load(client!, command.name, command.file, { mutable: values.mutable ?? false, host: values.host ?? false });
        out(result);
        break;
      }
      case 'store-dump': {
        const result = await dump(client!, command.store, command.file);
        // With the bytes on standard output, what was done goes to standard error.
        if (command.file === '-') process.stderr.write(`${json ? JSON.stringify(result.json) : result.text}\n`);
        else out(result);
        break;
      }
      case 'store-ls': {
        const stores = await view.stores.list();
        rows(
          stores.map((s) => ({
            id: s.id,
            name: s.name,
            target: s.target.replace('STORE_TARGET_', '').toLowerCase(),
            device: s.device,
            size: size(s.size),
            readOnly: s.readOnly,
            state: s.state.replace('STORE_STATE_', '').toLowerCase(),
            opens: s.opens,
            owner: s.ownerSession === '0' ? 'daemon' : `session ${s.ownerSession}`,
          })),
          stores,
        );
        break;
      }
      case 'store-rm': {
        const store = await client!.stores.detach(command.store);
        out({
          text: `detached store ${store.id}${store.name ? ` "${store.name}"` : ''}${store.opens > 0 ? `: freed when its ${store.opens} open(s) close` : ''}`,
          json: store,
        });
        break;
      }
    }
    return 0;
  } catch (error) {
    const failure = VmmdError.from(error);
    // Node's own messages start with their code already ("ENOENT: no such file …").
    const message = failure.message.startsWith(`${failure.code}:`) ? failure.message : `${failure.code}: ${failure.message}`;
    process.stderr.write(
      json ? `${JSON.stringify({ error: { code: failure.code, status: failure.statusName, message: failure.message } })}\n` : `vmmctl: ${message}\n`,
    );
    return failure.errorCode;
  } finally {
    client?.close();
    inspector?.close();
  }
}

if (require.main === module) {
  main(process.argv.slice(2)).then((code) => process.exit(code));
}
